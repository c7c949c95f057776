"""`tfgpt2 compare` (tfgpt2/cli/compare.py), the comparison behind it (tfgpt2.testing.reference_diff),
and the notebook."""
import os
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, execute_notebook, require_reference
from tfgpt2.testing import reference_diff
from tfgpt2.testing import reference as reference_module
from tfgpt2.formats.checkpoint import load_model
from tfgpt2.cli.compare import main

pytestmark = pytest.mark.slow  # the reference and the notebook in fresh processes

NOTEBOOK = ROOT / "notebooks" / "compare_with_reference.ipynb"


def test_tool_exits_0_where_both_agree(tiny_dir, capsys):
    assert main(["--model_dir", tiny_dir, "--reference_src", str(require_reference()), "--length", "5"]) == 0
    out = capsys.readouterr().out
    for line in ("first layer that differs: none", "top-5 tokens agree at 4 of 4 positions",
                 "same tokens: yes", "within tolerance"):
        assert line in out, out
    assert "h1 output" in out and "NO" not in out
    assert "greedy 5 tokens tfgpt2" in out


@pytest.mark.parametrize("variable, layer", [
    ("model/h1/mlp/c_proj/w", "h1"),
    ("model/h0/attn/c_attn/w", "h0"),
    ("model/ln_f/g", "none of the blocks; the difference is after them"),
])
def test_tool_exits_1_naming_the_first_layer_that_differs(tiny_dir, reference_tiny, monkeypatch, capsys, variable,
                                                          layer):
    """On the worker's reference process for the tiny folder (test_tool_exits_0_where_both_agree
    has the tool start its own): the tool perturbs its own model, never the reference's."""
    class Shared:
        def __init__(self, reference_src, folder):
            assert os.path.samefile(folder, tiny_dir)

        def __enter__(self):
            return reference_tiny

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(reference_module, "Reference", Shared)
    argv = ["--model_dir", tiny_dir, "--reference_src", str(require_reference()), "--length", "0",
            "--perturb", variable]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert f"first layer that differs: {layer}" in out, out
    assert "NOT within tolerance" in out
    if layer == "h1":
        assert all(line.endswith("yes") for line in out.splitlines() if line.startswith("h0 ")), out


@pytest.fixture
def fake_src(tmp_path):
    """A folder that passes the tool's check of --reference_src (it is not run)."""
    for name in ("model.py", "sample.py"):
        (tmp_path / name).write_text("")
    return str(tmp_path)


def one_line_exit(argv):
    """The message the tool exits with, checked to be one line."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    message = str(exit.value.code)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("args, message", [  # the request rules' messages (decoding/request.py)
    (["--length", "62"], "error: --prompt of 4 tokens + --length 62 - 1 exceeds the context window n_ctx=64"),
    (["--length", "100"], "error: --prompt of 4 tokens + --length 100 - 1 exceeds the context window n_ctx=64"),
    (["--prompt", "word" + " word" * 69], "error: --prompt of 70 tokens exceeds the context window n_ctx=64"),
    (["--prompt", ""], "error: --prompt: the prompt has no tokens; give at least one"),
])
def test_tool_rejects_a_prompt_that_does_not_fit(tiny_dir, fake_src, args, message):
    assert one_line_exit(["--model_dir", tiny_dir, "--reference_src", fake_src, *args]) == message


def test_tool_names_a_variable_that_does_not_exist(tiny_dir, fake_src):
    message = one_line_exit(["--model_dir", tiny_dir, "--reference_src", fake_src, "--perturb", "nope"])
    assert message.startswith("error: --perturb nope: no variable 'nope'; the model has model/ln_f/b, "
                              "model/ln_f/g, model/wpe, model/wte and model/h{0..1}/{attn/c_attn/b, "), message


def test_tool_names_a_wrong_model_dir(tmp_path, fake_src):
    message = one_line_exit(["--model_dir", str(tmp_path / "nope"), "--reference_src", fake_src])
    assert message.startswith(f"error: --model_dir {tmp_path / 'nope'}: {tmp_path / 'nope'}: no such model folder"), \
        message


@pytest.mark.parametrize("args", [["--reference_src", "/nonexistent/src"], ["--length", "-1"],
                                  ["--atol", "nan"], ["--hidden_rtol", "-0.1"], ["--length", "2.5"]])
def test_tool_refuses_bad_flags_in_one_line(tiny_dir, fake_src, capsys, args):
    argv = ["--model_dir", tiny_dir, "--reference_src", fake_src, *args]
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: argument {args[0]}: " in err and repr(args[1]) in err, err


def test_tool_names_a_reference_src_that_is_not_openais(tiny_dir):
    """tfgpt2/ has a model.py and a sample.py too, but they do not run as the original's."""
    message = one_line_exit(["--model_dir", tiny_dir, "--reference_src", str(ROOT / "tfgpt2"), "--length", "0"])
    assert message.startswith(f"error: --reference_src {ROOT / 'tfgpt2'}: OpenAI's code there failed: "), message


def test_greedy_is_argmax_of_a_full_recompute(tiny_dir):
    model = load_model(tiny_dir)
    tokens = np.array([[6109, 3626, 6100, 345], [6109, 1110, 6622, 257]], np.int32)
    expected = tokens
    for _ in range(5):
        logits = model(expected)["logits"].numpy()
        expected = np.concatenate([expected, logits[:, -1].argmax(-1)[:, None].astype(np.int32)], axis=1)
    np.testing.assert_array_equal(reference_diff.greedy(model, tokens, 5), expected)


def test_diff_is_relative_to_the_largest_reference_value():
    d = reference_diff.diff(np.array([1.0, 2.5]), np.array([1.0, -4.0]))
    assert (d.abs, d.rel) == (6.5, 6.5 / 4)
    assert reference_diff.diff(np.zeros(2), np.zeros(2)) == reference_diff.Diff(0.0, 0.0)
    assert reference_diff.diff(np.ones(2), np.zeros(2)).rel == np.inf


def test_notebook_executes_with_its_asserts(tiny_dir, monkeypatch):
    """Top to bottom in the kernel of this interpreter, on the worker's tiny folder handed over
    as TFGPT2_MODEL_DIR (without it the notebook writes 124M-shaped random weights with the same
    code; the 124M shape is compared with the reference in test_sample and test_precision)."""
    monkeypatch.setenv("TFGPT2_REFERENCE_SRC", str(require_reference()))
    monkeypatch.setenv("TFGPT2_MODEL_DIR", tiny_dir)
    stdout = execute_notebook(NOTEBOOK)
    assert f"python: {sys.executable}\n" in stdout
    assert "first layer that differs: None" in stdout and "first layer that differs: h1" in stdout
    assert "tying saves 38,597,376 parameters" in stdout
