#!/usr/bin/env python3
"""GFLOP/s of one GPT-2-shaped matmul in float32 and bfloat16, under XLA, TensorFlow's own
kernels (oneDNN on x86) and PyTorch, on this machine: whether 16-bit math can be faster here
at all, and the product rate that bounds a training step (`tools/benchmark_train.py`'s
model GFLOP/s).

    python tools/benchmark_matmul.py --m 512 --k 768 --n 3072 --runs 30

Reports the rate of each of `--runs` calls of [m, k] @ [k, n] (inputs made once, result reduced
to a float32 scalar so that only the product is timed), median and range, per dtype and
backend; over fewer calls, 3 at least, where the calls take over `--seconds` in all (PyTorch
emulates bfloat16 products without the instructions for them, at about 1 GFLOP/s). PyTorch runs
in a process of its own, under `$TFGPT2_HF_PYTHON` where set (as in
`tools/benchmark_train.py`), and is left out where torch is not installed there. The report
(tools/report.py) goes to `--report DIR` as `--name`.json and .md (default matmul).
"""
import argparse
import json
import subprocess
import sys
import time

try:
    from . import report
    from .benchmark_train import has_modules, hf_python
except ImportError:  # run as `python tools/benchmark_matmul.py`: this folder is on sys.path
    import report
    from benchmark_train import has_modules, hf_python


def gflops(product, args):
    """The product's rate of each timed call of `product()`, 2mkn / seconds, after one call."""
    product()  # compile
    seconds = []
    while len(seconds) < args.runs and (len(seconds) < 3 or sum(seconds) < args.seconds):
        start = time.perf_counter()
        product()
        seconds.append(time.perf_counter() - start)
    return [2 * args.m * args.k * args.n / s / 1e9 for s in seconds]


def tensorflow_rows(args):
    import tensorflow as tf
    for dtype in (tf.float32, tf.bfloat16):
        a = tf.cast(tf.random.normal([args.m, args.k]), dtype)
        b = tf.cast(tf.random.normal([args.k, args.n]), dtype)
        for backend, jit in (("XLA", True), ("TensorFlow", False)):
            fn = tf.function(lambda a, b: tf.reduce_sum(tf.cast(tf.matmul(a, b), tf.float32)), jit_compile=jit)
            yield dtype.name, backend, gflops(lambda: fn(a, b).numpy(), args)


def torch_rows(args):
    import torch
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(args.m, args.k, dtype=dtype), torch.randn(args.k, args.n, dtype=dtype)
        yield str(dtype).removeprefix("torch."), "PyTorch", gflops(lambda: (a @ b).float().sum().item(), args)


def torch_worker_rows(args):
    """PyTorch's rows from a process of its own, or none where torch is not installed there."""
    if not has_modules(hf_python(), "torch"):
        return
    flags = [f"--{k}={getattr(args, k)}" for k in ("m", "k", "n", "runs", "seconds")]
    out = subprocess.run([hf_python(), __file__, "--worker", *flags], capture_output=True, text=True, check=True)
    yield from json.loads(out.stdout.strip().splitlines()[-1])


COLUMNS = [report.column("dtype", "dtype"), report.column("backend", "backend"),
           report.column("gflops", "GFLOP/s", ".1f")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=512, help="rows (batch x tokens)")
    p.add_argument("--k", type=int, default=768)
    p.add_argument("--n", type=int, default=3072)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--seconds", type=float, default=20, help="stop timing a product after this long (3 calls at least)")
    report.add_arguments(p, "matmul")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return print(json.dumps(list(torch_rows(args))))
    rows = []
    for found in (tensorflow_rows(args), torch_worker_rows(args)):
        for dtype, backend, rates in found:
            print(f"measured {dtype} {backend}", file=sys.stderr, flush=True)
            rows.append({"dtype": dtype, "backend": backend, "gflops": report.spread(rates)})
    notes = [f"[{args.m}, {args.k}] @ [{args.k}, {args.n}]: GFLOP/s of each of up to {args.runs} calls "
             f"(3 at least, fewer where they take over {args.seconds:g} s in all) after one untimed call, "
             f"median and range. TensorFlow: its own kernels (oneDNN on x86); XLA: the same product under "
             f"`jit_compile`."]
    if not any(r["backend"] == "PyTorch" for r in rows):
        notes.append("PyTorch: not installed here.")
    settings = {k: getattr(args, k) for k in ("m", "k", "n", "runs", "seconds")}
    report.publish(args, "Matrix product speed", [report.table(COLUMNS, rows)], tool=__file__, argv=argv,
                   settings=settings, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
