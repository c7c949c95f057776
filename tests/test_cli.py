"""The `tfgpt2` command (`tfgpt2_cli` -> `tfgpt2.cli.main`): its help, --quiet and progress,
`generate --prompt`, the model flags of `export`, TensorFlow's start-up lines kept off stderr,
and `import tfgpt2` as all a fresh process needs for `keras.models.load_model`."""
import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
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


@pytest.mark.parametrize("flags", [["--min_p", "0.1"], ["--stop", "."], ["--logit_bias", "5=-100"],
                                   ["--repetition_penalty", "1.2"], ["--presence_penalty", "0.5"]])
def test_generate_litert_refuses_the_controls_it_cannot_apply(tmp_path, capsys, signals, flags):
    """A LiteRT file samples with temperature, top-k and top-p alone: a control is refused
    before the file is read, not ignored."""
    from tfgpt2.cli import generate
    with pytest.raises(SystemExit) as exit:
        generate.main(["--litert", str(tmp_path / "missing.tflite"), *flags])
    assert exit.value.code == 2
    assert "--litert samples with --temperature, --top_k and --top_p only" in capsys.readouterr().err


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
    failed = tfgpt2("generate", "--model_dir", str(tmp_path / "missing"), cwd=tmp_path)
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
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("usage: python -m tfgpt2.train ")
    for flag in ("--dataset", "--model_name", "--run_name", "--sample_every", "--save_every", "--restore_from"):
        assert flag in child.stdout
