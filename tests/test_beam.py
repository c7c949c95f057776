"""`tfgpt2 generate-batch --engine beam` (tfgpt2/bulk/beam.py, handlers.py) on the tiny model:
two pipelines in all, each on the DirectRunner in worker processes (each imports TensorFlow
and compiles): one through the model folder's handler in two, one through the SavedModel's in
one that cannot import tfgpt2."""
import ast
import contextlib
import glob
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, modules, resolve
from tfgpt2.cli import generate_batch
from tfgpt2.formats.checkpoint import load_model
from tfgpt2.formats.folders import encoder_of
from tfgpt2.sample import generate

pytest.importorskip("apache_beam", reason="the beam extra (apache-beam) is not installed")
slow = pytest.mark.slow  # Beam's worker processes each start TensorFlow and compile

RUNNER = ["--", "--runner", "DirectRunner", "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
GOOD = [dict(prompt="the cat sat on the mat"), dict(prompt="every effort moves you"), dict(prompt="a"),
        dict(prompt="time of the language model", min_p=0.3, repetition_penalty=1.5, logit_bias={"262": 100},
             stop=["zzz"], stop_at_eot=True),
        dict(prompt="you moves effort every", min_p=0.3, repetition_penalty=1.5, logit_bias={"262": 100},
             stop=["zzz"], stop_at_eot=True),
        dict(prompt="the tensor flow", temperature=1.0, top_k=5, seed=3)]
BAD = {1: (b"{not json", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                         "(char 1))"),
       4: (b'{"prompt": "caf\xe9"}', "not UTF-8: byte 0xe9 at byte 15 of the line"),
       6: (json.dumps(dict(prompt=" ".join(["cat"] * 60))).encode(),
           "prompt of 60 tokens + --length 8 - 1 exceeds the context window n_ctx=64"),
       8: (json.dumps(dict(prompt="cat", top_p=2)).encode(), "field 'top_p' must be a number in [0, 1], got 2")}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The input: the good lines, with the bad ones at their line numbers (BAD) among them.
    Returns (path, {line number: the good line's object})."""
    lines, good = [], {}
    for n in range(len(GOOD) + len(BAD)):
        if n in BAD:
            lines.append(BAD[n][0])
        else:
            good[n] = GOOD[len(good)]
            lines.append(json.dumps(good[n]).encode())
    path = tmp_path_factory.mktemp("beam") / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path), good


def shards(output):
    """{line: row} of the output's shards <output>-SSSSS-of-NNNNN, each line checked to be there once."""
    files = sorted(glob.glob(f"{output}-*"))
    assert files and all(f.endswith(f"-of-{len(files):05d}") for f in files), files
    rows = [json.loads(line) for f in files for line in open(f, encoding="utf-8")]
    assert len(rows) == len({r["line"] for r in rows}), "a line written twice"
    return {r["line"]: r for r in rows}


def run(tiny_dir, source, output, *flags, runner=RUNNER):
    return generate_batch.main(["--engine", "beam", "--model_dir", tiny_dir, "--input", source, "--output", str(output),
                                "--length", "8",
                                "--temperature", "0", "--batch_size", "2", "--quiet", *flags, *runner])


@contextlib.contextmanager
def stderr_into(path):
    """What this process (descriptor 2 and sys.stderr) and its children write to stderr while the
    block runs, into `path`."""
    saved, saved_stderr = os.dup(2), sys.stderr
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    sys.stderr = open(2, "w", closefd=False)
    try:
        yield
    finally:
        sys.stderr.close()
        sys.stderr = saved_stderr
        os.dup2(saved, 2)
        os.close(saved)


@pytest.fixture(scope="module")
def folder_rows(tiny_dir, source, tmp_path_factory):
    """The rows and the exit status of a run through the model folder's handler, its output, and
    what the run and its workers wrote to stderr."""
    output = tmp_path_factory.mktemp("folder") / "out" / "rows"
    stderr = output.parent.parent / "stderr"
    with pytest.MonkeyPatch.context() as patch, stderr_into(stderr):
        patch.setenv("PYTHONPATH", str(ROOT))  # the workers import tfgpt2 from this checkout
        status = run(tiny_dir, source[0], output)
    return shards(output), status, output, stderr.read_text()


@slow
def test_every_good_line_once_greedy_equal_to_each_prompt_alone(tiny_dir, source, folder_rows):
    """Greedy rows (--temperature 0) and lines with controls of their own are
    `tfgpt2.generate`'s for the prompt alone; the line with a seed samples as it would alone."""
    path, good = source
    rows, *_ = folder_rows
    assert sorted(rows) == sorted(good)
    model, enc = load_model(tiny_dir), encoder_of(tiny_dir)
    for n, line in good.items():
        keywords = dict(dict(temperature=0), **{k: v for k, v in line.items() if k != "prompt"})
        keywords["logit_bias"] = {int(k): v for k, v in keywords.get("logit_bias", {}).items()}
        context = enc.encode(line["prompt"])
        alone = generate(model, [context], 8, jit_compile=False, encoder=enc, **keywords)[0]
        assert (rows[n]["prompt"], rows[n]["tokens"], rows[n]["text"]) == (
            line["prompt"], alone.new_tokens.tolist(), alone.text), n
    free = generate(model, [enc.encode(good[5]["prompt"])], 8, temperature=0, jit_compile=False)[0]
    assert rows[5]["tokens"] != free[len(enc.encode(good[5]["prompt"])):].tolist(), "the line's fields changed nothing"


@slow
def test_bad_lines_are_written_with_their_number_and_the_run_exits_nonzero(source, folder_rows):
    """... each named on stderr once, as the local engine names them; and nothing else there
    (--quiet): TensorFlow's and Beam's notices, the workers' included, are kept off it."""
    path, _ = source
    _, status, output, stderr = folder_rows
    errors = [json.loads(line) for line in open(f"{output}.errors-00000-of-00001")]
    assert errors == [dict(line=n, error=problem) for n, (_, problem) in sorted(BAD.items())]
    assert status == f"error: 4 bad line(s) of {path}, written to {output}.errors-00000-of-00001, each named above " \
                     "(--skip_bad skips such lines)"
    assert stderr == "".join(f"{path}:{n + 1} (line {n} counted from 0): {problem}\n"
                             for n, (_, problem) in sorted(BAD.items()))
    assert not os.path.exists(f"{output}.plan.jsonl")


@slow
def test_an_output_with_an_earlier_runs_files_or_a_folder_is_refused(tiny_dir, source, folder_rows):
    _, _, output, _ = folder_rows
    before = sorted(os.listdir(output.parent))
    assert run(tiny_dir, source[0], output) == (
        f"error: {output}-00000-of-00002 exists, from an earlier run: remove {output}-*, {output}.errors-*, "
        f"{output}.plan.jsonl and the folder {output.parent}/beam-temp-rows-*, or choose another --output")
    assert run(tiny_dir, source[0], output.parent) == (
        f"error: --output {output.parent} is a folder: give the prefix of the files to write, for example "
        f"{output.parent / 'rows'}")
    assert sorted(os.listdir(output.parent)) == before


@slow
def test_the_saved_model_gives_the_same_rows_with_tensorflow_alone(tiny_dir, source, folder_rows, tmp_path,
                                                                    monkeypatch):
    """The SavedModel's handler, in a worker process where `import tfgpt2` raises (a package of
    that name first on its path): the rows of the model folder's handler, every one. One worker
    (one TensorFlow start-up and compile): the folder's run spreads the lines over two."""
    from tfgpt2.formats.saved_model import export_saved_model
    saved = export_saved_model(tiny_dir, str(tmp_path / "export"))
    trap = tmp_path / "trap" / "tfgpt2"
    trap.mkdir(parents=True)
    (trap / "__init__.py").write_text("raise ImportError('tfgpt2 imported in a Beam worker')\n")
    monkeypatch.setenv("PYTHONPATH", str(trap.parent))
    monkeypatch.chdir(tmp_path)  # the workers' current folder, first on their path: no tfgpt2 there
    tried = subprocess.run([sys.executable, "-c", "import tfgpt2"], capture_output=True, text=True)
    assert "tfgpt2 imported in a Beam worker" in tried.stderr  # the trap holds for the workers' interpreter
    output = tmp_path / "rows"
    one_worker = ["--", "--runner", "DirectRunner", "--direct_num_workers", "1", "--direct_running_mode",
                  "multi_processing"]
    assert run(tiny_dir, source[0], output, "--saved_model", saved, "--skip_bad", runner=one_worker) == 0
    assert shards(output) == folder_rows[0]


@slow
def test_a_batch_split_over_calls_gives_the_rows_of_the_whole(tiny_dir):
    """Sampled rows depend on their place in the batch: a handler given a batch in two parts
    puts each prompt at its row and gives the rows of the whole batch."""
    from tfgpt2.bulk import beam as bulk_beam, handlers
    enc = encoder_of(tiny_dir)
    batches = [[(n, text, enc.encode(text), ()) for n, text in enumerate(["the cat", "a mat sat", "of time"])]]
    (requests,) = bulk_beam.requests(batches, enc, seed=7, batch_size=4)
    model = handlers.GPT2ModelHandler(tiny_dir, dict(temperature=1.0, top_k=0, top_p=1.0), length=6,
                                      batch_size=4).load_model()
    whole = list(model.rows(requests))
    assert list(model.rows(requests[2:])) + list(model.rows(requests[:2])) == whole[2:] + whole[:2]
    alone = generate(model.model, [r["tokens"] for r in requests] + [requests[0]["tokens"]], 6, seed=7)
    assert [row["tokens"] for row in whole] == [a[len(r["tokens"]):].tolist() for a, r in zip(alone, requests)]


def loading_imports():
    """{module: the modules it imports as it is imported (not inside its functions)} over the
    package, relative imports resolved."""
    known = modules()
    found = {}
    for name, path in known.items():
        nodes = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        found[name] = {t for n in nodes for t in resolve(name, path.name == "__init__.py", n, known)}
    return found


def test_only_the_beam_engine_imports_beam():
    """`import tfgpt2` and the commands import no Apache Beam: only bulk/beam.py and
    bulk/handlers.py import it as they load, and the command imports them inside the function
    of --engine beam; handlers.py imports nothing of tfgpt2 as it loads (it runs on the
    SavedModel's workers)."""
    imports = loading_imports()
    assert {m for m, names in imports.items() if any(n.split(".")[0] == "apache_beam" for n in names)} == {
        "tfgpt2.bulk.beam", "tfgpt2.bulk.handlers"}
    assert {m for m, names in imports.items() if names & {"tfgpt2.bulk.beam", "tfgpt2.bulk.handlers"}} == {
        "tfgpt2.bulk.beam"}
    assert not [n for n in imports["tfgpt2.bulk.handlers"] if n.split(".")[0] == "tfgpt2"]


@slow
def test_a_failed_pipeline_is_one_line_and_writes_no_rows(tiny_dir, tmp_path):
    """A worker that cannot load its model (here the in-process runner's): PipelineError with
    the runner's last line, no shards, no plan file left (only Beam's beam-temp-* folder, as
    docs/distributed.md says)."""
    from tfgpt2.bulk import beam as bulk_beam, handlers
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "the cat"}\n')
    missing = str(tmp_path / "gone")
    handler = handlers.GPT2ModelHandler(missing, dict(temperature=0, top_k=0, top_p=1.0), length=4, batch_size=2)
    with pytest.raises(bulk_beam.PipelineError, match=f"the Beam pipeline failed: .*{missing}.* no rows were "
                                                      f"written to {tmp_path / 'rows'}-"):
        bulk_beam.generate_files(str(source), str(tmp_path / "rows"), handler, encoder_of(tiny_dir), n_ctx=64,
                                 n_vocab=50257, length=4, batch_size=2, seed=1)
    assert [name for name in sorted(os.listdir(tmp_path)) if not name.startswith("beam-temp-rows-")] == ["in.jsonl"]


def test_a_failed_pipeline_names_the_log_that_holds_the_runners_notices(tmp_path, capfd, monkeypatch):
    """What a failed run's workers wrote to descriptor 2 (here a child of the command's) is kept
    in the log that the error names, not shown; with --verbose it shows and no log is made."""
    from tfgpt2.bulk import beam as bulk_beam

    def failing(args, options):
        subprocess.run(["sh", "-c", "echo a notice of a worker >&2"], check=True)
        raise bulk_beam.PipelineError(f"the Beam pipeline failed: boom; no rows were written to {args.output}-*")
    monkeypatch.setattr(generate_batch, "beam_files", failing)
    argv = ["--engine", "beam", "--input", "in.jsonl", "--output", str(tmp_path / "rows"), "--quiet"]
    status = generate_batch.main(argv)
    log = status.rsplit("(the log ", 1)[-1].removesuffix(" has the rest)")
    assert status == (f"error: the Beam pipeline failed: boom; no rows were written to {tmp_path / 'rows'}-* "
                      f"(the log {log} has the rest)")
    assert capfd.readouterr().err == ""
    with open(log) as f:
        assert f.read() == "a notice of a worker\n"
    os.remove(log)
    assert generate_batch.main(argv + ["--verbose"]).endswith("(the log above has the rest)")
    assert capfd.readouterr().err == "a notice of a worker\n"
