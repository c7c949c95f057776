"""tools/benchmark_train.py: each candidate's figures from its own process."""
import argparse
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, TINY
from tools.benchmark_train import flops_per_token, run_worker
from tools.machine import describe


def benchmark(*flags):
    return subprocess.run([sys.executable, "tools/benchmark_train.py", *flags], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def test_accumulated_steps_count_every_micro_batch(tiny_dir):
    common = ("--model_dir", tiny_dir, "--batch", "2", "--length", "15", "--steps", "2", "--warmup", "1",
              "--candidates", "tfgpt2")
    out = benchmark(*common, "--accumulate", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accumulating 3" in out.stdout and describe() in out.stdout  # the machine, with the figures
    row = re.search(r"^\| tfgpt2 \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \|$", out.stdout, re.M)
    assert row, out.stdout
    tokens_per_s, gflops = map(float, row.groups())
    assert abs(gflops - tokens_per_s * flops_per_token(TINY, 15) / 1e9) <= 0.5 + 0.01 * gflops
    worker = benchmark("--worker", "tfgpt2", *common[:-2], "--accumulate", "3")
    figures = json.loads(worker.stdout.strip().splitlines()[-1])
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
def test_float32_baseline_runs_beside_the_options_given(tiny_dir):
    """tfgpt2-float32 trains in float32 with XLA whatever --precision and --no_xla say, while
    tfgpt2 takes them: the two workers' own account of what they ran, and both rows."""
    args = argparse.Namespace(model_dir=tiny_dir, batch=2, length=15, steps=1, warmup=1, precision="mixed_bfloat16",
                              optimizer="adam", accumulate=1, remat=False, no_xla=True)
    options, baseline = run_worker("tfgpt2", args), run_worker("tfgpt2-float32", args)
    assert (options["precision"], options["xla"]) == ("mixed_bfloat16", False), options
    assert (baseline["precision"], baseline["xla"]) == ("float32", True), baseline
    out = benchmark("--model_dir", tiny_dir, "--batch", "2", "--length", "15", "--steps", "1", "--warmup", "1",
                    "--candidates", "tfgpt2", "tfgpt2-float32", "--precision", "mixed_bfloat16", "--no_xla")
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("tfgpt2", "tfgpt2-float32"):
        assert re.search(rf"^\| {name} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out.stdout, re.M), out.stdout
