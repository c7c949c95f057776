"""tools/benchmark_matmul.py: a product's rate per dtype and backend, PyTorch's where installed."""
import pytest

from tools.benchmark_train import has_modules, hf_python
from tests.helpers import assert_report, rows, run_tool


@pytest.mark.slow  # a fresh TensorFlow process
def test_a_row_per_dtype_and_backend(tmp_path):
    done = run_tool("benchmark_matmul.py", "--m", "64", "--k", "96", "--n", "128", "--runs", "3",
                    "--report", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    data = assert_report(str(tmp_path), "matmul", "benchmark_matmul.py")
    expected = [(dtype, backend) for dtype in ("float32", "bfloat16") for backend in ("XLA", "TensorFlow")]
    if has_modules(hf_python(), "torch"):
        expected += [("float32", "PyTorch"), ("bfloat16", "PyTorch")]
    assert [(r["dtype"], r["backend"]) for r in rows(data)] == expected
    assert all(r["gflops"]["n"] == 3 for r in rows(data))
    assert "[64, 96] @ [96, 128]" in data["notes"][0]
    assert data["settings"] == {"m": 64, "k": 96, "n": 128, "runs": 3, "seconds": 20.0}
