"""tools/benchmark_matmul.py: a product's rate per dtype and backend, PyTorch's where installed."""
import re
import subprocess
import sys

from conftest import ROOT
from benchmarks.benchmark_train import has_modules, hf_python
from benchmarks.machine import describe


def test_rates_of_each_dtype_and_backend():
    out = subprocess.run([sys.executable, "benchmarks/benchmark_matmul.py", "--m", "64", "--k", "96", "--n", "128",
                          "--runs", "3"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[64, 96] @ [96, 128], median of up to 3 calls" in out.stdout and describe() in out.stdout
    rows = {(dtype, backend): float(rate)
            for dtype, backend, rate in re.findall(r"^\| (\w+) \| (\w+) \| ([\d.]+) \|$", out.stdout, re.M)}
    expected = {(dtype, backend) for dtype in ("float32", "bfloat16") for backend in ("XLA", "TensorFlow")}
    if has_modules(hf_python(), "torch"):
        expected |= {("float32", "PyTorch"), ("bfloat16", "PyTorch")}
    assert set(rows) == expected, out.stdout
    assert rows[("float32", "XLA")] > 0 and rows[("float32", "TensorFlow")] > 0
