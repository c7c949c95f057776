"""Bulk generation (`python -m tfgpt2 generate-batch`) on the tiny model (n_ctx 64)."""
import json
import os
import select
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT
from tfgpt2.bulk import pool
from tfgpt2.cli import generate_batch
from tfgpt2.formats.checkpoint import load_model
from tfgpt2.encoder import get_encoder
from tfgpt2.decoding.buckets import bucket
from tfgpt2.sample import generate

pytestmark = pytest.mark.slow  # compiled generation over many prompts, processes

ENV = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
WORDS = "the a cat sat on mat of time every effort moves you language model tensor flow".split()


def prompts(n, seed=0, words=45):
    """n prompts of 1 to `words` words (45: mixed lengths, several length buckets)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, words + 1))) for _ in range(n)]


def write_input(path, texts):
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def flags(model_dir, src, dst, *extra):
    models_dir, name = os.path.split(model_dir)
    return ["--models_dir", models_dir, "--model_name", name, "--input", src, "--output", str(dst), *extra]


def rows(path):
    """The output's rows, checked to hold each line number once."""
    out = [json.loads(line) for line in open(path)]
    lines = [r["line"] for r in out]
    assert len(lines) == len(set(lines)), "a line number appears twice"
    return {r["line"]: r for r in out}


@pytest.fixture(scope="module")
def model(tiny_dir):
    """The tiny model, shared so that XLA compiles each shape once for all tests."""
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def sampled(tiny_dir, tmp_path_factory, model):
    """80 prompts and their output from one uninterrupted sampled run. Batch size 1 makes 80
    batches (time to interrupt a run); short prompts keep to one bucket (one compile)."""
    tmp = tmp_path_factory.mktemp("sampled")
    src = write_input(tmp / "in.jsonl", prompts(80, seed=1, words=10))
    args = ["--length", "8", "--seed", "3", "--batch_size", "1", "--top_k", "40"]
    assert generate_batch.main(flags(tiny_dir, src, tmp / "full.jsonl", *args), model) == 0
    return src, args, rows(tmp / "full.jsonl")


def test_200_prompts_batched_equal_each_prompt_alone_greedy(tiny_dir, tmp_path, capsys, model):
    """Batches of 8 through XLA, against prompts alone without XLA: every fifth line, which
    holds every row of a batch and every bucket, as asserted (each compile of the tiny model
    costs seconds, so prompts of up to 26 words keep to three buckets)."""
    texts = prompts(200, words=26)
    src = write_input(tmp_path / "in.jsonl", texts)
    argv = flags(tiny_dir, src, tmp_path / "out.jsonl", "--length", "8", "--temperature", "0", "--batch_size", "8")
    assert generate_batch.main(argv, model) == 0
    assert "200/200 prompts" in capsys.readouterr().err
    got = rows(tmp_path / "out.jsonl")
    assert sorted(got) == list(range(200))
    enc = get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))
    assert len({bucket(len(enc.encode(text))) for text in texts[::5]}) == 3
    batches = generate_batch.input_batches(generate_batch.arguments(argv), enc, 64, 8, 50257)  # the run's batches
    assert {row for b in batches for row, (n, *_) in enumerate(b) if n % 5 == 0} == set(range(8))
    for n, text in list(enumerate(texts))[::5]:
        context = enc.encode(text)
        alone = generate(model, [context], 8, temperature=0, jit_compile=False)[0][len(context):].tolist()
        assert got[n]["prompt"] == text
        assert got[n]["tokens"] == alone, f"line {n}"
        assert got[n]["text"] == enc.decode(alone)


def test_batches_hold_one_length_bucket_each(tiny_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", prompts(200))
    args = generate_batch.arguments(flags(tiny_dir, src, tmp_path / "out.jsonl", "--batch_size", "8"))
    enc = get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))
    batches = generate_batch.input_batches(args, enc, 64, 8, 50257)
    assert sorted(n for b in batches for n, _, _, _ in b) == list(range(200))
    assert all(len({bucket(len(t)) for _, _, t, _ in b}) == 1 and len(b) <= 8 for b in batches)
    assert len({bucket(len(b[0][2])) for b in batches}) >= 3  # mixed lengths: several buckets
    assert sum(len(b) < 8 for b in batches) <= len({bucket(len(b[0][2])) for b in batches})


# `tfgpt2 generate-batch ARGS` in a child that says "held" on stdout once its 20th row is
# appended, then waits there (on its stdin) to be killed: a run killed partway, at a known point
# whatever the machine's speed.
HELD_AFTER_20_ROWS = """
import sys
from tfgpt2.bulk import pool
from tfgpt2.cli.main import main
append, written = pool.append, []

def held_after_20(path, rows):
    append(path, rows)
    written.extend(rows)
    if len(written) >= 20:
        print("held", flush=True)
        sys.stdin.read()

pool.append = held_after_20
main(["generate-batch", *sys.argv[1:]])
"""


def test_killed_run_resumed_has_every_line_once_and_the_same_text(tiny_dir, tmp_path, sampled, model):
    src, args, full = sampled
    out = tmp_path / "out.jsonl"
    with subprocess.Popen([sys.executable, "-c", HELD_AFTER_20_ROWS, *flags(tiny_dir, src, out, *args)], cwd=ROOT,
                          env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as child:
        ready, _, _ = select.select([child.stdout], [], [], 300)  # the child holds, or ends
        said = child.stdout.readline() if ready else "nothing in 300 s"
        child.kill()
        child.wait(timeout=60)
        assert said == "held\n", child.stderr.read()
    assert len(rows(out)) == 20  # --batch_size 1: a row per write
    assert generate_batch.main(flags(tiny_dir, src, out, *args), model) == 0
    assert rows(out) == full


def test_torn_and_repeated_rows_are_dropped_and_generated_again(tiny_dir, tmp_path, sampled, capsys, model):
    src, args, full = sampled
    out = tmp_path / "out.jsonl"
    lines = [json.dumps(full[n]) + "\n" for n in range(60)]
    out.write_text("".join(lines) + lines[3] + lines[3][:-1] + lines[5] + json.dumps(full[70])[:25])
    assert generate_batch.main(flags(tiny_dir, src, out, *args), model) == 0
    assert "dropped 3 torn or repeated line(s)" in capsys.readouterr().err
    assert rows(out) == full


def test_a_second_run_on_the_same_output_is_refused(tiny_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out.jsonl"
    held = pool.lock(str(out))
    try:
        assert generate_batch.main(flags(tiny_dir, src, out, "--length", "8")) == (
            f"error: {out}: another generate_batch run is writing it (it holds {out}.lock)")
    finally:
        pool.unlock(str(out), held)
    assert not out.exists() and not os.path.exists(f"{out}.lock")


def test_a_lock_file_removed_by_the_run_before_is_not_held(tmp_path, monkeypatch):
    """A run that opened the lock file just as the run before removed it (`unlock`) would lock a
    file no one else can see: `lock` opens the file at the path again."""
    path = str(tmp_path / "out.jsonl")
    real_open, opened = os.open, []

    def open_then_removed(name, *args):  # the run before unlocks between the first open and its flock
        opened.append(name)
        fd = real_open(name, *args)
        if len(opened) == 1:
            os.unlink(name)
        return fd
    monkeypatch.setattr(pool.os, "open", open_then_removed)
    held = pool.lock(path)
    monkeypatch.undo()
    assert opened == [f"{path}.lock"] * 2
    assert os.fstat(held).st_ino == os.stat(f"{path}.lock").st_ino  # the file there now
    with pytest.raises(ValueError, match="another generate_batch run is writing it"):
        pool.lock(path)
    pool.unlock(path, held)
    assert not os.path.exists(f"{path}.lock")


def test_two_workers_give_the_rows_of_one_process(tiny_dir, tmp_path, sampled):
    """... and the input's bad line, skipped, is named once (not once more by each worker)."""
    src, args, full = sampled
    with_bad = tmp_path / "in.jsonl"
    with_bad.write_text(open(src).read() + '{"prompt": ""}\n')  # line 80: the good lines' plan is the same
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "tfgpt2", "generate-batch", *flags(tiny_dir, str(with_bad), out, *args),
                           "--workers", "2", "--skip_bad"], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "worker 0/2:" in done.stderr and "worker 1/2:" in done.stderr
    assert done.stderr.count(f"skipped {with_bad}:81 (line 80 counted from 0): empty prompt\n") == 1, done.stderr
    assert done.stderr.count("skipped 1 bad line(s)") == 1, done.stderr
    assert rows(out) == full
    assert not os.path.exists(f"{out}.lock")


def test_bad_lines_are_named_or_skipped_with_a_count(tiny_dir, tmp_path, capsys, model):
    bad = {2: ('{"prompt": "unclosed', "not valid JSON"),
           3: ('["a list"]', 'not a JSON object with a string "prompt"'),
           4: ('{"text": "no prompt key"}', 'not a JSON object with a string "prompt"'),
           5: ('{"prompt": ""}', "empty prompt"),
           6: (json.dumps({"prompt": " ".join(["cat"] * 58)}),
               "prompt of 58 tokens + --length 8 - 1 exceeds the context window n_ctx=64")}
    src = tmp_path / "in.jsonl"
    good = json.dumps({"prompt": " ".join(["cat"] * 57)})  # 57 + 8 - 1 = 64 tokens fit
    src.write_text('{"prompt": "first"}\n\n' + "".join(line + "\n" for line, _ in bad.values()) + good + "\n")
    out = tmp_path / "out.jsonl"
    message = generate_batch.main(flags(tiny_dir, str(src), out, "--length", "8"))
    assert message == f"error: 5 bad line(s) of {src}, each named above (--skip_bad skips such lines)"
    named = [f"{src}:{n + 1} (line {n} counted from 0): {problem}" for n, (_, problem) in bad.items()]
    named[0] = named[0].replace("not valid JSON", "not valid JSON (Unterminated string starting at: line 1 column "
                                                  "12 (char 11))")
    assert capsys.readouterr().err == "".join(line + "\n" for line in named)  # every one, once, in one pass
    assert not out.exists()
    assert generate_batch.main(flags(tiny_dir, str(src), out, "--length", "8", "--batch_size", "1", "--skip_bad"),
                               model) == 0
    err = capsys.readouterr().err
    assert all(err.count(f"skipped {line}\n") == 1 for line in named), err
    assert err.count(f"skipped 5 bad line(s) of {src}\n") == 1
    assert sorted(rows(out)) == [0, 7]
    assert not os.path.exists(f"{out}.lock")


def test_controls_apply_to_every_line(tiny_dir, tmp_path, model):
    """--repetition_penalty, --logit_bias and --stop on every line: each row is the prompt's
    greedy row alone with the same controls, its text ending before a --stop text (the
    server's rule), its tokens those wholly before it."""
    enc = get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))
    texts = prompts(6, seed=4, words=6)
    contexts = [enc.encode(text) for text in texts]
    controls = dict(repetition_penalty=1.5, logit_bias={262: 5.0})
    free = generate(model, contexts[:1], 8, temperature=0, jit_compile=False, **controls)[0][len(contexts[0]):]
    stop = next(enc.decode([t]) for t in free[2:].tolist() if enc.encode(enc.decode([t])) == [t])
    src = write_input(tmp_path / "in.jsonl", texts)
    assert generate_batch.main(flags(tiny_dir, src, tmp_path / "out.jsonl", "--length", "8", "--temperature", "0",
                                     "--batch_size", "3", "--repetition_penalty", "1.5", "--logit_bias", "262=5",
                                     "--stop", stop), model) == 0
    got = rows(tmp_path / "out.jsonl")
    for n, context in enumerate(contexts):
        alone = generate(model, [context], 8, temperature=0, jit_compile=False, stop=[stop], encoder=enc, **controls)
        assert (got[n]["tokens"], got[n]["text"]) == (alone[0].new_tokens.tolist(), alone[0].text), f"line {n}"
    assert len(got[0]["tokens"]) < 8 and stop not in got[0]["text"]


LINE_CONTROLS = [{}, dict(repetition_penalty=1.5, logit_bias={"262": 5}, min_p=0.3, presence_penalty=2.0,
                         frequency_penalty=1.0, stop=["zzz"]),
                 dict(temperature=0.1, top_k=5, top_p=0.9, seed=3, stop_at_eot=True),
                 dict(repetition_penalty=1.5, logit_bias={"262": 5}, min_p=0.3, presence_penalty=2.0,
                      frequency_penalty=1.0, stop=["zzz"])]


@pytest.mark.slow
def test_lines_with_their_own_controls_equal_each_prompt_alone(tiny_dir, tmp_path, model):
    """Lines that set controls of their own (greedy by --temperature 0, one line seeded): each
    row is `tfgpt2.generate`'s for that prompt alone with the flags and the line's fields; only
    lines with the same fields share a batch; a resumed run writes the same row again."""
    enc = get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))
    texts = prompts(len(LINE_CONTROLS), seed=5, words=6)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(dict(prompt=t, **c)) + "\n" for t, c in zip(texts, LINE_CONTROLS)))
    out = tmp_path / "out.jsonl"
    argv = flags(tiny_dir, str(src), out, "--length", "8", "--temperature", "0", "--batch_size", "2")
    batches = generate_batch.input_batches(generate_batch.arguments(argv), enc, 64, 8, 50257)
    assert sorted(sorted(n for n, _, _, _ in b) for b in batches) == [[0], [1, 3], [2]]
    assert generate_batch.main(argv, model) == 0
    got = rows(out)
    for n, (text, fields) in enumerate(zip(texts, LINE_CONTROLS)):
        keywords = dict(dict(temperature=0), **fields)
        keywords["logit_bias"] = {int(k): v for k, v in keywords.get("logit_bias", {}).items()}
        context = enc.encode(text)
        alone = generate(model, [context], 8, jit_compile="seed" in fields, encoder=enc, **keywords)[0]
        assert (got[n]["tokens"], got[n]["text"]) == (alone.new_tokens.tolist(), alone.text), f"line {n}"
    free = generate(model, [enc.encode(texts[1])], 8, temperature=0, jit_compile=False)[0]
    assert got[1]["tokens"] != free[len(enc.encode(texts[1])):].tolist(), "the line's controls changed nothing"
    out.write_text("".join(json.dumps(r) + "\n" for n, r in got.items() if n != 2))
    assert generate_batch.main(argv, model) == 0
    assert rows(out) == got


@pytest.mark.parametrize("field, value, message", [
    ("top_p", 2, "field 'top_p' must be a number in [0, 1], got 2"),
    ("temperature", -1, "field 'temperature' must be a finite number >= 0, got -1"),
    ("seed", 1.5, "field 'seed' must be an integer in [0, 2**63), got 1.5"),
    ("logit_bias", {"50257": 1}, "field 'logit_bias' token must be a token id in [0, n_vocab=50257), got 50257"),
    ("logit_bias", {"x": 1}, "field 'logit_bias' keys must be token ids in decimal digits, got 'x'"),
    ("stop", 5, "field 'stop' must be a string or a list of strings, got 5"),
    ("stop", [""], "field 'stop' 0 must be 1 to 64 bytes of UTF-8, got 0: ''"),
    ("min_tokens", 9, "field 'min_tokens' must be at most --length (4), got 9"),
    ("stop_at_eot", 1, "field 'stop_at_eot' must be true or false, got 1"),
    ("repetition_penalty", 0, "field 'repetition_penalty' must be a finite number > 0, got 0"),
])
def test_a_bad_field_names_the_line_and_the_field(tiny_dir, tmp_path, capsys, field, value, message):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "first"}\n' + json.dumps({"prompt": "second", field: value}) + "\n")
    out = tmp_path / "out.jsonl"
    assert generate_batch.main(flags(tiny_dir, str(src), out, "--length", "4")) == \
        f"error: 1 bad line(s) of {src}, each named above (--skip_bad skips such lines)"
    assert capsys.readouterr().err == f"{src}:2 (line 1 counted from 0): {message}\n"
    assert not out.exists()


def test_a_line_not_utf8_and_a_folder_as_output_are_errors_that_write_nothing(tiny_dir, tmp_path, capsys, model):
    """As a user types them (the `tfgpt2` script is `python -m tfgpt2_cli`): a line in Latin-1
    is a bad line named with the file and the line (--skip_bad skips and counts it), and an
    --output that is a folder is refused in one line; neither writes anything."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt": "first"}\n{"prompt": "caf\xe9 au lait"}\n{"prompt": "third"}\n')
    models_dir, name = os.path.split(tiny_dir)
    command = f"tfgpt2 generate-batch --models_dir {models_dir} --model_name {name} --input {src} --length 4"
    not_utf8 = f"{src}:2 (line 1 counted from 0): not UTF-8: byte 0xe9 at byte 15 of the line\n" \
               f"error: 1 bad line(s) of {src}, each named above (--skip_bad skips such lines)"
    folder = f"error: --output {tmp_path} is a folder: give the file to append the rows to, for example " \
             f"{tmp_path / 'rows.jsonl'}"
    for output, message in [(tmp_path / "out.jsonl", not_utf8), (tmp_path, folder)]:
        typed = f"{command} --output {output}".replace("tfgpt2", f"{sys.executable} -m tfgpt2_cli", 1)
        done = subprocess.run(typed.split(), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stderr) == (1, message + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    assert generate_batch.main(flags(tiny_dir, str(src), tmp_path / "out.jsonl", "--length", "4", "--skip_bad"),
                               model) == 0
    assert "skipped 1 bad line(s)" in capsys.readouterr().err
    assert sorted(rows(tmp_path / "out.jsonl")) == [0, 2]
