"""benchmarks/benchmark_train.py: each candidate in its own process, one report row each."""
import subprocess
import sys

import pytest

from benchmarks.benchmark_train import flops_per_token
from conftest import ROOT, TINY
from test_benchmarks import assert_report, rows, run_tool


def test_accumulated_steps_count_every_micro_batch(tiny_dir, tmp_path):
    done = run_tool("benchmark_train.py", "--model_dir", tiny_dir, "--batch", "2", "--length", "15", "--steps", "2",
                    "--warmup", "1", "--candidates", "tfgpt2", "--accumulate", "3", "--report", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "train", "benchmark_train.py")
    [row] = rows(data)
    assert row["implementation"] == "tfgpt2" and row["setup"] == "float32, XLA"
    assert row["tokens_per_step"] == 3 * 2 * 15 and row["tokens_per_s"]["n"] == 2
    assert "accumulating 3 micro-batches" in data["notes"][0]
    # model GFLOP/s is tokens/s times the work per token, step by step
    flops = flops_per_token(TINY, 15)
    assert data["settings"]["flops_per_token"] == flops
    for key in ("median", "min", "max"):
        assert row["gflops"][key] == pytest.approx(row["tokens_per_s"][key] * flops / 1e9)


def test_flops_per_token_of_124m():
    """6 per weight of the products (85M in the blocks, 38.6M in the output layer) and 12 per
    position and feature per layer for attention: 755 MFLOP per token at 128 positions."""
    hparams = dict(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)
    blocks, output = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072), 768 * 50257
    assert flops_per_token(hparams, 128) == 6 * (blocks + output) + 12 * 12 * 128 * 768 == 755_347_968


def test_accumulate_is_tfgpt2s_alone(tiny_dir):
    out = subprocess.run([sys.executable, "benchmarks/benchmark_train.py", "--model_dir", tiny_dir, "--accumulate",
                          "2", "--candidates", "tfgpt2", "keras-hub"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2 and "--accumulate is tfgpt2's alone" in out.stderr


@pytest.mark.slow
def test_float32_baseline_runs_beside_the_options_given(tiny_dir, tmp_path):
    """tfgpt2-float32 trains in float32 with XLA whatever --precision and --no_xla say, while
    tfgpt2 takes them: the workers' own account of what they ran, in the report's rows."""
    done = run_tool("benchmark_train.py", "--model_dir", tiny_dir, "--batch", "2", "--length", "15", "--steps", "1",
                    "--warmup", "1", "--candidates", "tfgpt2", "tfgpt2-float32", "keras-hub",
                    "--precision", "mixed_bfloat16", "--no_xla", "--repeats", "2", "--report", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "train", "benchmark_train.py")
    setups = {r["implementation"]: r["setup"] for r in rows(data)}
    assert setups.pop("tfgpt2") == "mixed_bfloat16" and setups.pop("tfgpt2-float32") == "float32, XLA"
    assert setups in ({}, {"keras-hub": "float32, XLA"})  # where KerasHub is installed
    for row in rows(data):
        assert row["processes"] == 2 and row["first_step_s"]["n"] == 2 and row["tokens_per_s"]["n"] == 2
    import importlib.util
    if importlib.util.find_spec("keras_hub") is None:
        assert "Not installed here: keras-hub." in data["notes"]
