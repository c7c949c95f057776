#!/usr/bin/env python3
"""The exported SavedModel's `generate` against the in-process XLA path (`tfgpt2.sample.generate`).

    python tools/benchmark_export.py                          # a 124M-shaped random model
    python tools/benchmark_export.py --model_dir models/124M --batch 1 8

Reports the export time and the SavedModel's size beside the checkpoint's, then per batch size
each path's time per generated token: the difference between generating `--long` and `--short`
new tokens (both in one total-length bucket, so one compiled program) divided by the difference,
from the medians of `--runs` runs after a warm-up, whose time is shown as the first call (XLA
compilation included). Runs of the two paths alternate, in one process.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorflow as tf  # noqa: E402

from tfgpt2.formats.checkpoint import load_model  # noqa: E402
from tfgpt2.formats.saved_model import checkpoint_bytes, export_saved_model, folder_bytes  # noqa: E402
from tfgpt2.hparams import published_hparams  # noqa: E402
from tfgpt2.sample import generate  # noqa: E402
from tfgpt2.testing.checkpoints import make_checkpoint  # noqa: E402


def paths(model, saved_model, *, top_k, seed=0):
    """name -> run(prompts [batch, P] array, length), each returning once the tokens are ready."""
    signature = tf.saved_model.load(saved_model).signatures["generate"]

    def library(prompts, length):
        generate(model, prompts.tolist(), length, top_k=top_k, seed=seed)

    def served(prompts, length):
        signature(input_ids=tf.constant(prompts), attention_mask=tf.ones_like(prompts),
                  max_new_tokens=tf.constant(length), temperature=tf.constant(1.0), top_k=tf.constant(top_k),
                  top_p=tf.constant(1.0), seed=tf.constant(seed, tf.int64))["output_ids"].numpy()
    return {"in-process XLA": library, "SavedModel": served}


def seconds(run, *args):
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def per_token(runs, prompts, *, short, long, repeats):
    """name -> (first call s, s per token): medians of alternating runs after a warm-up."""
    first = {name: seconds(run, prompts, long) + seconds(run, prompts, short) for name, run in runs.items()}
    times = {(name, n): [] for name in runs for n in (short, long)}
    for _ in range(repeats):
        for name, run in runs.items():
            for n in (short, long):
                times[name, n].append(seconds(run, prompts, n))
    return {name: (first[name], (statistics.median(times[name, long]) - statistics.median(times[name, short]))
                   / (long - short)) for name in runs}


def benchmark(model_dir, export_dir, *, batches=(1,), prompt_len=8, short=49, long=80, repeats=5, top_k=40):
    """Export `model_dir` into `export_dir` and time both paths; returns a dict of results."""
    start = time.perf_counter()
    saved_model = export_saved_model(model_dir, export_dir)
    result = {"export s": time.perf_counter() - start, "checkpoint MB": checkpoint_bytes(model_dir) / 1e6,
              "variables MB": folder_bytes(os.path.join(saved_model, "variables")) / 1e6,
              "SavedModel MB": folder_bytes(saved_model) / 1e6, "batches": {}}
    model = load_model(model_dir)
    runs = paths(model, saved_model, top_k=top_k)
    n_vocab = model.hparams.n_vocab
    for batch in batches:
        prompts = np.random.default_rng(batch).integers(0, n_vocab, [batch, prompt_len], dtype=np.int32)
        result["batches"][batch] = per_token(runs, prompts, short=short, long=long, repeats=repeats)
    return result


def table(result):
    lines = [f"export {result['export s']:.1f} s; SavedModel {result['SavedModel MB']:.1f} MB, of which variables/ "
             f"{result['variables MB']:.1f} MB (checkpoint data {result['checkpoint MB']:.1f} MB)", "",
             "| batch | path | first call s | ms per token | vs in-process |", "|---:|---|---:|---:|---:|"]
    for batch, paths_ in result["batches"].items():
        base = paths_["in-process XLA"][1]
        for name, (first, token) in paths_.items():
            lines.append(f"| {batch} | {name} | {first:.1f} | {token * 1e3:.2f} | {token / base:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="a model folder (default: a 124M-shaped one, std 0.1, made here)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt_len", type=int, default=8)
    parser.add_argument("--short", type=int, default=49)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top_k", type=int, default=40)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tfgpt2-export-bench-") as tmp:
        model_dir = args.model_dir or make_checkpoint(os.path.join(tmp, "124M"), published_hparams("124M"), std=0.1)
        result = benchmark(model_dir, os.path.join(tmp, "export"), batches=args.batch, prompt_len=args.prompt_len,
                           short=args.short, long=args.long, repeats=args.runs, top_k=args.top_k)
    print(f"$ python tools/benchmark_export.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
