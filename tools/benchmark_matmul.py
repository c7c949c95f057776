#!/usr/bin/env python3
"""GFLOP/s of one GPT-2-shaped matmul in float32 and bfloat16, under XLA and TensorFlow's own
kernels (oneDNN on x86), on this machine: whether 16-bit math can be faster here at all.

    python tools/benchmark_matmul.py --m 512 --k 768 --n 3072 --runs 30

Prints the median over `--runs` calls of [m, k] @ [k, n] (inputs made once, result reduced to a
float32 scalar so that only the product is timed), per dtype and backend.
"""
import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.machine import describe  # noqa: E402


def gflops(fn, a, b, runs):
    fn(a, b).numpy()  # compile
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(a, b).numpy()
        seconds.append(time.perf_counter() - start)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / float(np.median(seconds)) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=512, help="rows (batch x tokens)")
    p.add_argument("--k", type=int, default=768)
    p.add_argument("--n", type=int, default=3072)
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    print(f"| dtype | backend | GFLOP/s |  ([{args.m}, {args.k}] @ [{args.k}, {args.n}], median of {args.runs}; {describe()})\n"
          f"|---|---|---:|")
    for dtype in (tf.float32, tf.bfloat16):
        a = tf.cast(tf.random.normal([args.m, args.k]), dtype)
        b = tf.cast(tf.random.normal([args.k, args.n]), dtype)
        for backend, jit in (("XLA", True), ("TensorFlow", False)):
            fn = tf.function(lambda a, b: tf.reduce_sum(tf.cast(tf.matmul(a, b), tf.float32)), jit_compile=jit)
            print(f"| {dtype.name} | {backend} | {gflops(fn, a, b, args.runs):.0f} |", flush=True)


if __name__ == "__main__":
    main()
