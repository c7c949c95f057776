"""tools/benchmark_train.py: each candidate's figures from its own process."""
import json
import re
import subprocess
import sys

from conftest import ROOT
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
    assert re.search(r"^\| tfgpt2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out.stdout, re.M), out.stdout
    worker = benchmark("--worker", "tfgpt2", *common[:-2], "--accumulate", "3")
    figures = json.loads(worker.stdout.strip().splitlines()[-1])
    assert figures["tokens_per_step"] == 3 * 2 * 15 and figures["tokens_per_s"] > 0


def test_accumulate_is_tfgpt2s_alone(tiny_dir):
    out = benchmark("--model_dir", tiny_dir, "--accumulate", "2", "--candidates", "tfgpt2", "keras-hub")
    assert out.returncode == 2 and "--accumulate is tfgpt2's alone" in out.stderr
