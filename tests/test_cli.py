"""The `tfgpt2` command (`tfgpt2_cli` -> `tfgpt2.cli.main`): its help, --quiet and progress,
`generate --prompt`, the model flags of `export`, TensorFlow's start-up lines kept off stderr,
and `import tfgpt2` as all a fresh process needs for `keras.models.load_model`."""
import contextlib
import importlib
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT
from tfgpt2.cli import common, generate_batch
from tfgpt2.cli import main as cli
from tfgpt2.cli.export import main as export_main

def cli_env():
    """The environment a user's shell gives: the checkout importable, no TF_CPP_MIN_LOG_LEVEL
    (conftest sets one for the tests' own process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def tfgpt2(*args, cwd, timeout=300):
    """`tfgpt2 ARGS` as the console script runs it (`tfgpt2_cli.main`), in a fresh process."""
    return subprocess.run([sys.executable, "-m", "tfgpt2_cli", *args], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def help_text(name):
    """`tfgpt2 NAME --help`, run in this process: (exit status, stdout)."""
    module = importlib.import_module(cli.module_name(name))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = module.main(["--help"], prog=f"tfgpt2 {name}")
        except SystemExit as e:
            code = e.code
    return code, out.getvalue()


def test_top_level_help_lists_every_command_on_one_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^  (\S+) +\S.*$", out, re.M)
    assert listed[:len(cli.COMMANDS)] == list(cli.COMMANDS)
    assert "--quiet" in out
    assert cli.main([]) == 2 and "commands:" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2 and "tfgpt2: unknown command 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_has_help_with_tfgpt2_examples_and_quiet(name):
    code, out = help_text(name)
    assert code == 0
    assert out.startswith(f"usage: tfgpt2 {name} "), out[:200]
    examples = re.findall(rf"^ +(?:\S.* \| )?tfgpt2 {re.escape(name)} \S.*$", out, re.M)
    assert examples, f"no `tfgpt2 {name} ...` example in its --help:\n{out}"
    assert "--quiet" in out


def test_help_subcommand_is_the_commands_help(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["help", "params"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith("usage: tfgpt2 params ")
    with pytest.raises(SystemExit) as exit:  # as `python -m tfgpt2` calls it
        cli.main(["help", "params"], prog="python -m tfgpt2")
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m tfgpt2 params ")
    assert cli.main(["--help"], prog="python -m tfgpt2") == 0
    assert capsys.readouterr().out.startswith("usage: python -m tfgpt2 <command> [options]")


def test_progress_notes_and_bars_are_off_with_quiet(capsys):
    loud, quiet = common.Progress(False), common.Progress(True)
    loud.note("loading")
    quiet.note("loading")
    assert capsys.readouterr().err == "loading\n"
    assert quiet.bar(3, unit="x").disable
    assert loud.bar(3, unit="x").disable  # stderr is not a terminal here: no bar, only lines


def test_encode_shows_progress_unless_quiet(tmp_path, capsys):
    from tfgpt2.cli import encode
    (tmp_path / "a.txt").write_text("Hello world. " * 10)
    encode.main([str(tmp_path / "a.txt"), str(tmp_path / "a.npz")])
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {tmp_path / 'a.npz'}: 31 tokens in 1 chunks")
    assert f"reading and encoding {tmp_path / 'a.txt'}" in err
    encode.main([str(tmp_path / "a.txt"), str(tmp_path / "b.npz"), "--quiet"])
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote {tmp_path / 'b.npz'}") and err == ""


def test_export_takes_the_model_as_the_other_commands(tmp_path, capsys):
    """--model_name in --models_dir (or --model_dir), and the export folder as an argument;
    a missing model is named before anything is written."""
    with pytest.raises(SystemExit) as exit:
        export_main(["--models_dir", str(tmp_path), "--model_name", "nope", str(tmp_path / "exports")])
    assert exit.value.code == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope'}: no such model folder (the published models " \
                                      "are 124M, 355M, 774M, 1558M)\n"
    with pytest.raises(SystemExit) as exit:
        export_main(["--model_dir", str(tmp_path)])
    assert exit.value.code == 2 and "the export folder is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        export_main(["a", "--export_dir", "b"])
    assert exit.value.code == 2 and "two export folders: a and --export_dir b" in capsys.readouterr().err
    assert not (tmp_path / "exports").exists()


def test_generate_refuses_an_empty_prompt(tiny_dir, capsys, signals):
    from tfgpt2.cli import generate
    with pytest.raises(SystemExit) as exit:
        generate.main(["--model_dir", tiny_dir, "--prompt", ""])
    assert exit.value.code == 2
    assert "argument --prompt: the prompt is empty" in capsys.readouterr().err


def test_generate_litert_refuses_context_keep(tmp_path, capsys, signals):
    """A LiteRT file's cache holds n_ctx positions: --context_keep is refused before the file is
    read, not ignored (every other control applies: test_litert)."""
    from tfgpt2.cli import generate
    with pytest.raises(SystemExit) as exit:
        generate.main(["--litert", str(tmp_path / "missing.tflite"), "--context_keep", "8"])
    assert exit.value.code == 2
    assert "--context_keep does not apply to --litert" in capsys.readouterr().err



def test_notices_of_the_process_and_its_children_go_to_a_log_removed_unless_kept(capfd):
    """`common.Notices`: descriptor 2 (this process's and a child's writes) into a temporary
    log, removed on leaving unless kept, and descriptor 2 as it was after, also where the block
    raised; with verbose, nothing moves."""
    def notices():
        subprocess.run(["sh", "-c", "echo a notice of a child >&2"], check=True)
        os.write(2, b"a notice\n")
    with common.Notices(False) as quiet:
        notices()
    assert capfd.readouterr().err == "" and not os.path.exists(quiet.log)
    with pytest.raises(RuntimeError), common.Notices(False) as kept:
        notices()
        kept.keep = True
        raise RuntimeError
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n" and kept.where() == f"the log {kept.log}"
    with open(kept.log) as f:
        assert f.read() == "a notice of a child\na notice\n"
    os.remove(kept.log)
    with common.Notices(True) as verbose:
        notices()
    assert capfd.readouterr().err == "a notice of a child\na notice\n" and verbose.log is None

def test_generate_batch_workers_start_through_the_quiet_entry_point():
    assert generate_batch.worker_command() == [sys.executable, "-m", "tfgpt2_cli", "generate-batch"]


@pytest.mark.slow
def test_evaluate_and_generate_batch_show_progress_unless_quiet(tiny_dir, tmp_path, capsys):
    from tfgpt2.cli import evaluate
    from tfgpt2.formats.checkpoint import load_model
    text = "The quick brown fox jumps over the lazy dog. " * 12
    (tmp_path / "text.txt").write_text(text)
    n = len(common.encoder_of(tiny_dir).encode(text))  # scored: all of them, after <|endoftext|>
    argv = ["--model_dir", tiny_dir, "--dataset", str(tmp_path / "text.txt")]
    evaluate.main(argv)
    out, err = capsys.readouterr()
    assert re.fullmatch(rf"tokens {n}  loss [0-9.]+  perplexity [0-9.]+  bits per byte [0-9.]+\n", out), out
    assert f"loading {tiny_dir}\n" in err and f"scoring {n} tokens in 2 windows of up to 64 tokens" in err
    evaluate.main(argv + ["--quiet"])
    quiet_out, quiet_err = capsys.readouterr()
    assert quiet_out == out and quiet_err == ""

    (tmp_path / "in.jsonl").write_text('{"prompt": "Hello"}\n{"prompt": "World"}\n')
    models_dir, name = os.path.split(tiny_dir)
    argv = ["--models_dir", models_dir, "--model_name", name, "--input", str(tmp_path / "in.jsonl"),
            "--length", "4", "--seed", "1"]
    model = load_model(tiny_dir)
    assert generate_batch.main(argv + ["--output", str(tmp_path / "a.jsonl")], model) == 0
    assert "2/2 prompts" in capsys.readouterr().err
    assert generate_batch.main(argv + ["--output", str(tmp_path / "b.jsonl"), "--quiet"], model) == 0
    assert capsys.readouterr().err == ""
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


@pytest.mark.slow
def test_the_command_keeps_tensorflows_start_up_lines_off_stderr_but_not_later_errors(tmp_path):
    """An error after TensorFlow's start-up still reaches stderr, alone. (That a command which
    runs the model prints nothing on stderr, tests/test_package.py checks for every command the
    README shows, through the wheel's `tfgpt2`.)"""
    args = ["generate", "--model_dir", str(tmp_path / "missing")]
    module = subprocess.run([sys.executable, "-m", "tfgpt2", *args], cwd=tmp_path, env=cli_env(), capture_output=True,
                            text=True, timeout=300)  # `python -m tfgpt2`, where the script is not on the PATH
    for failed in (tfgpt2(*args, cwd=tmp_path), module):
        assert failed.returncode == 1
        assert failed.stderr == f"error: {tmp_path / 'missing'}: no such model folder (the published models are " \
                                "124M, 355M, 774M, 1558M)\n"


@pytest.mark.slow
def test_import_tfgpt2_is_all_keras_load_model_needs_in_a_fresh_process(tiny_dir, tmp_path):
    """Without it Keras cannot find the class; with `import tfgpt2` alone (no tfgpt2.model import
    in the script) the .keras file loads as a GPT2 whose logits are the saved model's, bit for bit."""
    from tfgpt2.formats.checkpoint import load_model
    tokens = np.array([[5, 17, 99, 0, 42], [1, 2, 3, 4, 5]], np.int32)
    model = load_model(tiny_dir)
    model.save(tmp_path / "gpt2.keras")
    np.save(tmp_path / "tokens.npy", tokens)
    script = f"""
import json, sys
import keras, numpy as np
try:
    keras.models.load_model({str(tmp_path / 'gpt2.keras')!r})
    before = "loaded"
except Exception as e:
    before = type(e).__name__ + ": " + str(e).splitlines()[0]
import tfgpt2
model = keras.models.load_model({str(tmp_path / 'gpt2.keras')!r})
np.save({str(tmp_path / 'logits.npy')!r}, model(np.load({str(tmp_path / 'tokens.npy')!r}))["logits"].numpy())
print(json.dumps({{"before": before, "class": type(model).__module__ + "." + type(model).__name__,
                   "gpt2": isinstance(model, tfgpt2.GPT2)}}))
"""
    child = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=cli_env(), capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.splitlines()[-1])
    assert "GPT2" in got["before"] and got["before"] != "loaded", got["before"]  # the import is what does it
    assert got["class"] == "tfgpt2.model.GPT2" and got["gpt2"]
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), model(tokens)["logits"].numpy())


@pytest.mark.slow
def test_python_m_tfgpt2_train_keeps_its_name_and_the_forks_flags(tmp_path):
    """(tests/test_scripts.py runs the two sample scripts under their `python -m` names.)"""
    child = subprocess.run([sys.executable, "-m", "tfgpt2.train", "--help"], cwd=tmp_path, env=cli_env(),
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stderr == "", child.stderr  # TensorFlow's start-up lines kept off
    assert child.stdout.startswith("usage: python -m tfgpt2.train ")
    for flag in ("--dataset", "--model_name", "--run_name", "--sample_every", "--save_every", "--restore_from"):
        assert flag in child.stdout


@pytest.mark.slow
def test_a_command_starts_without_matplotlib_and_a_program_keeps_it(tmp_path):
    """Keras imports matplotlib.pyplot as TensorFlow starts, for its plots: a command (here the
    console script's module imported first) starts without it, and can still import it after;
    a program that imports tfgpt2 keeps Keras' plots."""
    script = """
import sys
{first}
import tfgpt2, keras
before = "matplotlib" in sys.modules
import matplotlib.pyplot
from keras.src.visualization import plot_image_gallery
print(before, plot_image_gallery.plt is not None)
"""
    for first, expected in [("import tfgpt2_cli", "False False"), ("", "True True")]:
        child = subprocess.run([sys.executable, "-c", script.format(first=first)], cwd=tmp_path, env=cli_env(),
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr[-3000:]
        assert child.stdout.split() == expected.split(), (first, child.stdout)


# Nothing lost, nothing replaced: what each command writes over, and its one-line errors

def contents(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


def test_make_checkpoint_replaces_no_folder_and_guesses_no_size(tmp_path, capsys):
    """Over a folder with files (downloaded weights, say; gpt2 is 124M): refused, the folder
    unchanged. A name that is no published size: refused without --hparams (it took 124M's)."""
    from tfgpt2.cli import make_checkpoint
    models = tmp_path / "models"
    (models / "124M").mkdir(parents=True)
    (models / "124M" / "model.ckpt.index").write_bytes(b"downloaded")
    for name in ("124M", "gpt2"):
        with pytest.raises(SystemExit) as exit:
            make_checkpoint.main([name, "--models_dir", str(models), "--quiet"])
        assert exit.value.code == 1
        assert capsys.readouterr().err == (f"error: {models / '124M'} is a folder with files in it; choose another, "
                                           "or pass --overwrite to write into it (replacing the files of the same "
                                           "names)\n")
    with pytest.raises(SystemExit) as exit:
        make_checkpoint.main(["mine", "--models_dir", str(models)])
    assert exit.value.code == 2
    assert "'mine' is no published size (124M, 355M, 774M, 1558M): give its shape with --hparams" in \
        capsys.readouterr().err
    assert contents(models) == {"124M/model.ckpt.index": b"downloaded"}
    tiny = json.dumps({"n_ctx": 8, "n_embd": 8, "n_head": 2, "n_layer": 1})
    assert make_checkpoint.main(["124M", "--models_dir", str(models), "--hparams", tiny, "--overwrite",
                                 "--quiet"]) == 0
    assert json.loads((models / "124M" / "hparams.json").read_text())["n_embd"] == 8
    for seed in ("-1", str(2**63)):  # the seed's one range (tfgpt2.seeds), as the library's
        with pytest.raises(SystemExit) as exit:
            make_checkpoint.main(["124M", "--models_dir", str(models), "--seed", seed])
        assert exit.value.code == 2
        assert f"argument --seed: must be an integer in [0, 2**63), got '{seed}'" in capsys.readouterr().err


def test_encode_writes_a_file_not_a_folder_and_replaces_nothing(tmp_path, capsys):
    """`encode corpus.txt /tmp` wrote /tmp.npz: a folder is refused, naming a file to write in
    it; an existing .npz is kept without --overwrite; an unknown --encoding is a usage error."""
    from tfgpt2.cli import encode
    (tmp_path / "a.txt").write_text("Hello world. " * 10)
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as exit:
        encode.main([str(tmp_path / "a.txt"), str(tmp_path / "out")])
    assert exit.value.code == 2
    assert f"{tmp_path / 'out'} is a folder; name the .npz file to write in it, e.g. " \
           f"{tmp_path / 'out' / 'corpus.npz'}" in capsys.readouterr().err
    assert not (tmp_path / "out.npz").exists()
    (tmp_path / "old.npz").write_bytes(b"earlier")
    with pytest.raises(SystemExit, match=r"old.npz exists; choose another name, or pass --overwrite to replace it"):
        encode.main([str(tmp_path / "a.txt"), str(tmp_path / "old.npz")])
    assert (tmp_path / "old.npz").read_bytes() == b"earlier"
    encode.main([str(tmp_path / "a.txt"), str(tmp_path / "old"), "--overwrite", "--quiet"])
    assert (tmp_path / "old.npz").read_bytes()[:2] == b"PK"


@pytest.mark.parametrize("command", ["encode", "evaluate", "train"])
def test_an_unknown_encoding_is_a_usage_error(command, tmp_path, capsys):
    argv = {"encode": [str(tmp_path / "a.txt"), str(tmp_path / "a.npz")], "evaluate": ["--dataset", "a.txt"],
            "train": ["--dataset", "a.txt"]}[command] + ["--encoding", "nope-8"]
    with pytest.raises(SystemExit) as exit:
        importlib.import_module(cli.module_name(command)).main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "--encoding: unknown text encoding 'nope-8' (for example utf-8, latin-1, cp1252)" in err
    assert len(err.splitlines()) == 1


def test_the_docs_sample_commands_end(tmp_path):
    """`tfgpt2 generate` without --prompt generates until interrupted (--nsamples 0, as the
    original): every example of it in the README, the docs and the commands' help sets
    --nsamples."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tfgpt2" / "cli").glob("*.py"))]
    pattern = re.compile(r"(?:tfgpt2 generate|python -m tfgpt2\.generate_unconditional_samples)(?![-\w])[^\n`|]*")
    examples = [(path.name, m.group(0)) for path in texts for m in pattern.finditer(path.read_text())]
    assert len(examples) > 5
    endless = [(name, line) for name, line in examples
               if " --" in line and "--nsamples" not in line and "--prompt" not in line and "--help" not in line]
    assert not endless


def interrupted(args, ready, cwd):
    """`tfgpt2 ARGS` in a child (SIGINT at its default, as a shell leaves it), sent SIGINT once
    its stderr shows `ready`: (exit status, stderr)."""
    with subprocess.Popen([sys.executable, "-m", "tfgpt2_cli", *args], cwd=cwd, env=cli_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as child:
        err = ""
        while ready not in err:
            line = child.stderr.readline()
            assert line, err
            err += line
        child.send_signal(signal.SIGINT)
        err += child.stderr.read()
        return child.wait(timeout=120), err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "evaluate"])
def test_ctrl_c_ends_a_command_with_status_130_in_one_line(command, tiny_dir, tmp_path):
    """Ctrl-C (SIGINT) during `export` or `evaluate`: status 130, the shell's for an interrupted
    command, a line saying so and no traceback; an interrupted export leaves no version folder."""
    (tmp_path / "long.txt").write_text("It was the best of times, it was the worst of times. " * 100000)
    args, ready = {"export": (["--model_dir", tiny_dir, str(tmp_path / "exports")], "tracing the serving_default"),
                   "evaluate": (["--model_dir", tiny_dir, "--dataset", str(tmp_path / "long.txt")],
                                "reading and encoding")}[command]
    status, err = interrupted([command, *args], ready, tmp_path)
    assert status == 130 and err.endswith(f"\ntfgpt2 {command}: interrupted\n") and "Traceback" not in err, err
    if command == "export":  # no version folder, nor a hidden one half written
        assert not (tmp_path / "exports").exists() or os.listdir(tmp_path / "exports") == []


@pytest.mark.slow
def test_generate_says_a_batch_that_does_not_fit_in_memory(tiny_dir, tmp_path):
    """`generate --batch_size 100000`: 20 GB for the tiny model's logits alone. The
    child's address space is capped (8 GiB) so that the allocation fails at once wherever the
    test runs: one line saying so, and no banner of a sample that never comes. Without oneDNN,
    TensorFlow's plain CPU allocator: oneDNN's pool waits 10 s for memory to be freed before it
    raises the same ResourceExhaustedError."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    child = subprocess.run([sys.executable, "-m", "tfgpt2_cli", "generate", "--model_dir", tiny_dir, "--batch_size",
                            "100000", "--nsamples", "1", "--length", "8", "--quiet"], cwd=tmp_path,
                           env=dict(cli_env(), CUDA_VISIBLE_DEVICES="", TF_ENABLE_ONEDNN_OPTS="0"), capture_output=True, text=True, timeout=300,
                           preexec_fn=cap)
    assert child.returncode == 1 and child.stdout == ""
    assert child.stderr == ("error: out of memory generating --batch_size 100000 samples of 8 tokens at once: "
                            "use a smaller --batch_size\n")
