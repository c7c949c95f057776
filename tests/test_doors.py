"""One engine behind every door: the same requests through the library (`tfgpt2.generate`), the
commands (`tfgpt2 interactive`), `tfgpt2 generate-batch` on both engines (local, Beam), `tfgpt2
serve` (its HTTP app over the scheduler), the SavedModel (`generate_text`) and LiteRT give the
same text (and the same log-probabilities, where a door reports them), each row equal to its
prompt generated alone by the library: greedy (with log-probabilities where a door reports
them), seeded sampling, stop strings inside a token and across two, penalties with a logit bias.

Affordable: the tiny model, loaded once and handed to every door that can take it (the commands
and bulk generation load it through `load_model`, patched for the module), one app, one
SavedModel and one LiteRT file for all the cases."""
import dataclasses
import io
import json
import re

import numpy as np
import pytest

from tfgpt2.encoder import get_encoder

pytestmark = pytest.mark.slow  # compiles every door's programs for the tiny model
LENGTH = 12
PROMPTS = ["The cat sat on", "Every effort moves you"]


@dataclasses.dataclass
class Case:
    """A request: its prompts and controls (the library's keywords)."""
    prompts: list
    controls: dict


def cases(free):
    """The requests; the stop strings are taken from `free`, the greedy texts without controls:
    one inside a token of the first prompt's text, one across two tokens of the second's."""
    (inside_token, across), texts = free
    return {
        "greedy": Case(PROMPTS, dict(temperature=0.0, logprobs=3)),
        "sampled": Case(PROMPTS[:1], dict(temperature=1.0, top_k=40, top_p=0.9, seed=7)),
        "stops": Case(PROMPTS, dict(temperature=0.0, stop=[inside_token, across])),
        "controls": Case(PROMPTS, dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5,
                                       frequency_penalty=0.5, logit_bias={262: 5.0, int(texts[0][1]): -100.0})),
    }


def without_logprobs(controls):
    """The controls for a door that reports no log-probabilities (the text is the same)."""
    return {k: v for k, v in controls.items() if k != "logprobs"}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from tfgpt2 import load_model
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def enc(tiny_dir):
    import os
    return get_encoder(os.path.basename(tiny_dir), os.path.dirname(tiny_dir))


@pytest.fixture(scope="module")
def free(tiny, enc):
    """(a stop string inside a token of the first prompt's greedy text and one across two tokens
    of the second's, each first found there; the greedy new tokens of each prompt)."""
    from tfgpt2 import generate
    rows = [generate(tiny, [enc.encode(p)], LENGTH, temperature=0, stop_at_eot=True, encoder=enc)[0] for p in PROMPTS]
    tokens = [row.new_tokens.tolist() for row in rows]
    words = [[enc.decode([t]) for t in row] for row in tokens]
    j = next(j for j, w in enumerate(words[0]) if len(w.strip()) >= 3 and j > 0)
    inside = words[0][j].strip()[1:3]  # the middle of a token
    k = next(k for k in range(2, len(words[1]) - 1) if words[1][k].strip() and words[1][k + 1].strip()
             and words[1][k + 1][0] != " ")
    across = words[1][k][-1] + words[1][k + 1][0]
    assert inside in rows[0].text and across in rows[1].text
    return (inside, across), tokens


@pytest.fixture(scope="module")
def expected(tiny, enc, free):
    """Each case's rows by the library, each prompt alone: {case: [Completion]}."""
    from tfgpt2 import generate
    return {name: [generate(tiny, [enc.encode(p)], LENGTH, stop_at_eot=True, encoder=enc, **case.controls)[0]
                   for p in case.prompts] for name, case in cases(free).items()}


def test_the_cases_show_what_they_are_for(expected, free, tiny, enc):
    """Each case changes the text where it should: the stop strings end the texts, one inside a
    token and one across two; the penalties with the bias, and sampling, change the greedy text;
    the greedy case reports 3 most likely tokens per step."""
    from tfgpt2 import generate
    (inside, across), _ = free
    greedy = [c.text for c in expected["greedy"]]
    stopped = [c.text for c in expected["stops"]]
    assert stopped[0] == greedy[0][:greedy[0].find(inside)] and stopped[1] == greedy[1][:greedy[1].find(across)]
    assert all(c.finish_reason == "stop" for c in expected["stops"])
    assert [c.text for c in expected["controls"]] != greedy and expected["sampled"][0].text != greedy[0]
    assert len(expected["greedy"][0].logprobs[0][1]) == 3
    assert generate(tiny, [enc.encode(PROMPTS[0])], LENGTH, temperature=0, stop_at_eot=True,
                    encoder=enc)[0].text == greedy[0]  # log-probabilities change nothing


def test_library_rows_in_one_batch_equal_each_prompt_alone(tiny, enc, free, expected):
    from tfgpt2 import generate
    for name, case in cases(free).items():
        rows = generate(tiny, [enc.encode(p) for p in case.prompts], LENGTH, stop_at_eot=True, encoder=enc,
                        **case.controls)
        assert [r.text for r in rows] == [e.text for e in expected[name]], name
        if "logprobs" in case.controls:
            assert_logprobs([r.logprobs for r in rows], [e.logprobs for e in expected[name]])


def assert_logprobs(got, want, tolerance=1e-4):
    """Per row and token: the same top ids, log-probabilities within `tolerance`."""
    for g, w in zip(got, want):
        assert len(g) == len(w)
        for (lp, top), (wlp, wtop) in zip(g, w):
            assert abs(lp - wlp) <= tolerance and [t for t, _ in top] == [t for t, _ in wtop]
            np.testing.assert_allclose([v for _, v in top], [v for _, v in wtop], atol=tolerance)


# ---- the commands -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny):
    """`load_model` hands the module's model to the commands and bulk generation."""
    from tfgpt2.formats import checkpoint
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "load_model", lambda folder, **options: tiny)
        yield


def flags(controls):
    """The controls as the commands' flags."""
    out = []
    for name, value in controls.items():
        if name == "stop":
            out += [x for text in value for x in ("--stop", text)]
        elif name == "logit_bias":
            out += [x for token, v in value.items() for x in ("--logit_bias", f"{token}={v}")]
        else:
            out += [f"--{name}", str(value)]
    return out


def test_interactive_prints_the_same_text(tiny_dir, free, expected, loaded, capsys, monkeypatch):
    """`tfgpt2 interactive`, the prompts on stdin: each sample's text (--stop on text, as the
    server's stop)."""
    from tfgpt2.cli import interactive
    for name, case in cases(free).items():
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(p + "\n" for p in case.prompts)))
        interactive.main(["--model_dir", tiny_dir, "--length", str(LENGTH), "--stop_at_eot", "--quiet",
                          *flags(without_logprobs(case.controls))])
        printed = re.split(r"^=+ SAMPLE 1 =+\n", capsys.readouterr().out, flags=re.M)[1:]
        assert [p.split("\n" + "=" * 80 + "\n")[0] for p in printed] == [e.text for e in expected[name]], name


def bulk_lines(free):
    lines = []
    for name, case in cases(free).items():
        fields = dict(without_logprobs(case.controls), stop_at_eot=True)
        fields["logit_bias"] = {str(k): v for k, v in fields.get("logit_bias", {}).items()}
        lines += [dict(prompt=p, case=name, **fields) for p in case.prompts]
    return lines


def bulk_texts(rows, lines):
    texts = {}
    for row in sorted(rows, key=lambda r: r["line"]):
        texts.setdefault(lines[row["line"]]["case"], []).append(row["text"])
    return texts


@pytest.mark.parametrize("engine", ["local", "beam"])
def test_generate_batch_writes_the_same_text(tiny_dir, free, expected, loaded, tmp_path, engine):
    """`tfgpt2 generate-batch`, every case's lines in one file, each line with its fields: the
    same text on both engines (the rows of a case share a batch)."""
    from tfgpt2.cli import generate_batch
    if engine == "beam":
        pytest.importorskip("apache_beam", reason="the beam extra (apache-beam) is not installed")
    lines = bulk_lines(free)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["--model_dir", tiny_dir, "--input", str(src), "--output", str(out), "--length", str(LENGTH),
            "--batch_size", "2", "--quiet", "--engine", engine]
    assert generate_batch.main(argv) == 0
    files = [out] if engine == "local" else sorted(tmp_path.glob("out-*-of-*"))
    rows = [json.loads(line) for f in files for line in open(f)]
    assert bulk_texts(rows, lines) == {name: [e.text for e in rows_] for name, rows_ in expected.items()}


# ---- the server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny, enc):
    """`tfgpt2 serve`'s app over a scheduler of the module's model, in this process."""
    from fastapi.testclient import TestClient
    from tfgpt2.decoding.stops import Vocabulary
    from tfgpt2.serve.app import create_app
    from tfgpt2.serve.scheduler import Scheduler
    scheduler = Scheduler(tiny, max_batch=4, max_queue=8, chunk=16, eot=enc.eot_token, vocabulary=Vocabulary.of(enc))
    with TestClient(create_app(scheduler, model_name="tiny", encoder=enc, hparams=tiny.hparams)) as client:
        yield client


def test_the_server_answers_the_same_text_and_log_probabilities(server, enc, free, expected):
    from tfgpt2.decoding.text import token_text
    for name, case in cases(free).items():
        body = dict(model="tiny", prompt=case.prompts, max_tokens=LENGTH, **case.controls)
        body["logit_bias"] = {str(k): v for k, v in body.get("logit_bias", {}).items()}
        answer = server.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert [c["text"] for c in choices] == [e.text for e in expected[name]], name
        if "logprobs" in case.controls:  # OpenAI's shape: the tokens' texts, not their ids
            word = enc.encoding.decode_single_token_bytes
            for choice, want in zip(choices, expected[name]):
                got = choice["logprobs"]
                assert got["tokens"] == [token_text(word(t)) for t in want.new_tokens]
                np.testing.assert_allclose(got["token_logprobs"], [lp for lp, _ in want.logprobs], atol=1e-4)
                for top, (_, wanted) in zip(got["top_logprobs"], want.logprobs):
                    assert list(top) == [token_text(word(t)) for t, _ in wanted]
                    np.testing.assert_allclose(list(top.values()), [v for _, v in wanted], atol=1e-4)


# ---- the SavedModel and LiteRT --------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_model(tiny, enc, tmp_path_factory):
    import tensorflow as tf
    from tfgpt2.formats.saved_model import export_saved_model
    path = export_saved_model(tiny, str(tmp_path_factory.mktemp("saved")), encoder=enc)
    loaded = tf.saved_model.load(path)
    return loaded, loaded.signatures["generate_text"]


def test_the_saved_model_gives_the_same_text(saved_model, enc, free, expected):
    import tensorflow as tf
    _, run = saved_model
    for name, case in cases(free).items():
        c = dict(dict(temperature=1.0, top_k=0, top_p=1.0, seed=0, repetition_penalty=1.0, presence_penalty=0.0,
                      frequency_penalty=0.0), **without_logprobs(case.controls))
        prompts = [enc.encode(p) for p in case.prompts]
        width = max(map(len, prompts))
        ids, mask = np.zeros([len(prompts), width], np.int32), np.zeros([len(prompts), width], np.int32)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
        bias = np.zeros(50257, np.float32)
        for token, value in case.controls.get("logit_bias", {}).items():
            bias[token] = value
        out = run(input_ids=tf.constant(ids), attention_mask=tf.constant(mask), max_new_tokens=tf.constant(LENGTH),
                  temperature=tf.constant(c["temperature"], tf.float32), top_k=tf.constant(c["top_k"]),
                  top_p=tf.constant(c["top_p"], tf.float32), seed=tf.constant(c["seed"], tf.int64),
                  logit_bias=tf.constant(bias),
                  **{k: tf.constant(c[k], tf.float32) for k in ("repetition_penalty", "presence_penalty",
                                                                 "frequency_penalty")},
                  min_p=tf.constant(0.0), stop=tf.constant(np.full([0, 1], -1, np.int32)),
                  stop_strings=tf.constant(case.controls.get("stop", []), tf.string, shape=[len(case.controls.get(
                      "stop", []))]), min_tokens=tf.constant(0), stop_at_eot=tf.constant(True),
                  include_stop_str_in_output=tf.constant(False))
        assert [t.decode() for t in out["text"].numpy()] == [e.text for e in expected[name]], name


def test_litert_gives_the_same_text_and_log_probabilities(tiny, enc, free, expected, tmp_path):
    pytest.importorskip("ai_edge_litert", reason="ai-edge-litert is not installed (requirements.txt)")
    from tfgpt2.formats.litert import export_litert, generate_litert
    path = export_litert(tiny, str(tmp_path / "tiny.tflite"))
    for name, case in cases(free).items():
        rows = generate_litert(path, [enc.encode(p) for p in case.prompts], LENGTH, stop_at_eot=True, encoder=enc,
                               **case.controls)
        assert [r.text for r in rows] == [e.text for e in expected[name]], name
        if "logprobs" in case.controls:
            assert_logprobs([r.logprobs for r in rows], [e.logprobs for e in expected[name]])
