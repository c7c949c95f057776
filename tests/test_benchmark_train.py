"""tools/benchmark_train.py: each candidate's figures from its own process."""
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TINY
from benchmarks import benchmark_train
from benchmarks.benchmark_train import flops_per_token
from benchmarks.machine import describe


def benchmark(*flags):
    return subprocess.run([sys.executable, "benchmarks/benchmark_train.py", *flags], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def benchmark_here(monkeypatch, capsys, *flags):
    """The tool's output, run in this process (each worker still in its own), and the
    figures each worker returned."""
    figures, run_worker = [], benchmark_train.run_worker
    monkeypatch.setattr(benchmark_train, "run_worker", lambda *a: figures.append(run_worker(*a)) or figures[-1])
    monkeypatch.setattr(sys, "argv", ["benchmark_train.py", *flags])
    benchmark_train.main()
    return capsys.readouterr().out, figures


def test_accumulated_steps_count_every_micro_batch(tiny_dir, monkeypatch, capsys):
    out, [figures] = benchmark_here(monkeypatch, capsys, "--model_dir", tiny_dir, "--batch", "2", "--length", "15",
                                    "--steps", "2", "--warmup", "1", "--candidates", "tfgpt2", "--accumulate", "3")
    assert "accumulating 3" in out and describe() in out  # the machine, with the figures
    row = re.search(r"^\| tfgpt2 \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \|$", out, re.M)
    assert row, out
    tokens_per_s, gflops = map(float, row.groups())
    assert abs(gflops - tokens_per_s * flops_per_token(TINY, 15) / 1e9) <= 0.5 + 0.01 * gflops
    assert figures["tokens_per_step"] == 3 * 2 * 15 and figures["tokens_per_s"] > 0


def test_flops_per_token_of_124m():
    """6 per weight of the products (85M in the blocks, 38.6M in the output layer) and 12 per
    position and feature per layer for attention: 755 MFLOP per token at 128 positions."""
    hparams = dict(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)
    blocks, output = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072), 768 * 50257
    assert flops_per_token(hparams, 128) == 6 * (blocks + output) + 12 * 12 * 128 * 768 == 755_347_968


def test_accumulate_is_tfgpt2s_alone(tiny_dir):
    out = benchmark("--model_dir", tiny_dir, "--accumulate", "2", "--candidates", "tfgpt2", "keras-hub")
    assert out.returncode == 2 and "--accumulate is tfgpt2's alone" in out.stderr


@pytest.mark.slow
def test_float32_baseline_runs_beside_the_options_given(tiny_dir, monkeypatch, capsys):
    """tfgpt2-float32 trains in float32 with XLA whatever --precision and --no_xla say, while
    tfgpt2 takes them: the two workers' own account of what they ran, and both rows."""
    out, [options, baseline] = benchmark_here(
        monkeypatch, capsys, "--model_dir", tiny_dir, "--batch", "2", "--length", "15", "--steps", "1", "--warmup", "1",
        "--candidates", "tfgpt2", "tfgpt2-float32", "--precision", "mixed_bfloat16", "--no_xla")
    assert (options["precision"], options["xla"]) == ("mixed_bfloat16", False), options
    assert (baseline["precision"], baseline["xla"]) == ("float32", True), baseline
    for name in ("tfgpt2", "tfgpt2-float32"):
        assert re.search(rf"^\| {name} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
