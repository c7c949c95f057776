#!/usr/bin/env python3
"""The exported SavedModel's `generate` against the in-process XLA path (`tfgpt2.sample.generate`).

    python tools/benchmark_export.py                     # a 124M-shaped random model, made here
    python tools/benchmark_export.py --model_dir models/124M --batch 1 8

Reports the export time and the SavedModel's size beside the checkpoint's, then per batch size
each path's time per generated token: the difference between generating `--long` and `--short`
new tokens (both in one total-length bucket, so one compiled program) divided by the difference,
per pair of runs (the median and range over `--runs` pairs) after a warm-up, whose time is
shown as the first call (XLA compilation included). Runs of the two paths alternate, in one
process. The report (tools/report.py) goes to `--report DIR` as `--name`.json and .md
(default export).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import tensorflow as tf

from tfgpt2.formats.checkpoint import load_model
from tfgpt2.formats.saved_model import checkpoint_bytes, export_saved_model, folder_bytes
from tfgpt2.hparams import published_hparams
from tfgpt2.sample import generate
from tfgpt2.testing.checkpoints import make_checkpoint

try:
    from . import report
except ImportError:  # run as `python tools/benchmark_export.py`: this folder is on sys.path
    import report


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
    """name -> (first call s, [s per token of each pair of runs]), runs alternating after a warm-up."""
    first = {name: seconds(run, prompts, long) + seconds(run, prompts, short) for name, run in runs.items()}
    times = {(name, n): [] for name in runs for n in (short, long)}
    for _ in range(repeats):
        for name, run in runs.items():
            for n in (short, long):
                times[name, n].append(seconds(run, prompts, n))
    return {name: (first[name], [(lg - sh) / (long - short) for lg, sh in zip(times[name, long], times[name, short])])
            for name in runs}


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


SIZES = [report.column("export_s", "export s", ".1f"), report.column("saved_model_mb", "SavedModel MB", ".1f"),
         report.column("variables_mb", "of which variables/ MB", ".1f"),
         report.column("checkpoint_mb", "checkpoint data MB", ".1f")]
PATHS = [report.column("batch", "batch"), report.column("path", "path"),
         report.column("first_call_s", "first call s", ".1f"), report.column("ms_per_token", "ms per token", ".2f"),
         report.column("vs_in_process", "time vs in-process", ".2f")]


def tables(result):
    """The report's two tables: the export, and each path's speed per batch size."""
    sizes = {"export_s": result["export s"], "saved_model_mb": result["SavedModel MB"],
             "variables_mb": result["variables MB"], "checkpoint_mb": result["checkpoint MB"]}
    rows = []
    for batch, paths_ in result["batches"].items():
        base = statistics.median(paths_["in-process XLA"][1])
        for name, (first, token) in paths_.items():
            rows.append({"batch": batch, "path": name, "first_call_s": first,
                         "ms_per_token": report.spread([t * 1e3 for t in token]),
                         "vs_in_process": statistics.median(token) / base})
    return [report.table(SIZES, [sizes], "Export"), report.table(PATHS, rows, "Generation")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="a model folder (default: a 124M-shaped one, std 0.1, made here)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes, each timed")
    parser.add_argument("--prompt_len", type=int, default=8, help="prompt tokens (random ids)")
    parser.add_argument("--short", type=int, default=49, help="new tokens of the short run of a pair")
    parser.add_argument("--long", type=int, default=80, help="new tokens of the long run (same bucket)")
    parser.add_argument("--runs", type=int, default=5, help="pairs of runs per path and batch size")
    parser.add_argument("--top_k", type=int, default=40, help="the sampling's top_k")
    report.add_arguments(parser, "export")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tfgpt2-export-bench-") as tmp:
        model_dir = args.model_dir or make_checkpoint(os.path.join(tmp, "124M"), published_hparams("124M"), std=0.1)
        result = benchmark(model_dir, os.path.join(tmp, "export"), batches=args.batch, prompt_len=args.prompt_len,
                           short=args.short, long=args.long, repeats=args.runs, top_k=args.top_k)
    notes = [f"The SavedModel's `generate` signature against `tfgpt2.generate` (XLA) in the same process: "
             f"time per generated token from {args.long} and {args.short} new tokens after a {args.prompt_len}-token "
             f"prompt, per pair of runs (median and range over {args.runs}), top_k={args.top_k}; first call: "
             f"both lengths' first calls, compilation included."]
    if not args.model_dir:
        notes.append("Weights: random, 124M-shaped (std 0.1), made by the tool.")
    settings = {k: getattr(args, k) for k in ("model_dir", "batch", "prompt_len", "short", "long", "runs", "top_k")}
    report.publish(args, "SavedModel export", tables(result), tool=__file__, argv=argv, settings=settings,
                   notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
