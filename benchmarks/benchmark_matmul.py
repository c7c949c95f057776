#!/usr/bin/env python3
"""GFLOP/s of one GPT-2-shaped matmul in float32 and bfloat16, under XLA, TensorFlow's own
kernels (oneDNN on x86) and PyTorch, on this machine: whether 16-bit math can be faster here
at all, and the product rate that bounds a training step (`tools/benchmark_train.py`'s model
GFLOP/s).

    python tools/benchmark_matmul.py --m 512 --k 768 --n 3072 --runs 30

Prints the median over `--runs` calls of [m, k] @ [k, n] (inputs made once, result reduced to a
float32 scalar so that only the product is timed), per dtype and backend; over fewer calls, 3 at
least, where the calls take over `--seconds` in all (PyTorch emulates bfloat16 products without
the instructions for them, at about 1 GFLOP/s). PyTorch runs in a process of its own, under
`$TFGPT2_HF_PYTHON` where set (as in `tools/benchmark_train.py`), and is left out where torch
is not installed there.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.benchmark_train import has_modules, hf_python  # noqa: E402
from benchmarks.machine import describe  # noqa: E402


def gflops(product, args):
    """The product's rate: 2mkn over the median seconds of `product()`, after one call."""
    product()  # compile
    seconds = []
    while len(seconds) < args.runs and (len(seconds) < 3 or sum(seconds) < args.seconds):
        start = time.perf_counter()
        product()
        seconds.append(time.perf_counter() - start)
    return 2 * args.m * args.k * args.n / float(np.median(seconds)) / 1e9


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
    yield from json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=512, help="rows (batch x tokens)")
    p.add_argument("--k", type=int, default=768)
    p.add_argument("--n", type=int, default=3072)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--seconds", type=float, default=20, help="stop timing a product after this long (3 calls at least)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return print(json.dumps(list(torch_rows(args))))
    print(f"| dtype | backend | GFLOP/s |  ([{args.m}, {args.k}] @ [{args.k}, {args.n}], median of up to {args.runs} "
          f"calls within {args.seconds:g} s; {describe()})\n|---|---|---:|")
    for rows in (tensorflow_rows(args), torch_worker_rows(args)):
        for dtype, backend, rate in rows:
            print(f"| {dtype} | {backend} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
