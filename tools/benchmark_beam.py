#!/usr/bin/env python3
"""Rows per second of `tfgpt2 generate-batch --engine beam` (the DirectRunner with two worker
processes) against the local engine with `--workers 2`, on the same input.

    python tools/benchmark_beam.py                      # a 124M-shaped random model, made here
    python tools/benchmark_beam.py --model_dir models/124M --prompts 512 --runs 5

Each run is the command as a user types it, in a fresh process on a fresh output, timed from
its start to its exit: TensorFlow's start-up, loading, compiling (once per length bucket and
worker) and, for Beam, the pipeline's own work, all included; runs of the two engines
alternate. Rows/s is prompts / seconds (the median and range over `--runs`). The tool checks
that both engines wrote the same rows. The report (tools/report.py) goes to
`--report DIR` as `--name`.json and .md (default beam).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from tfgpt2.hparams import published_hparams
from tfgpt2.testing.checkpoints import make_checkpoint

try:
    from . import report
except ImportError:  # run as `python tools/benchmark_beam.py`: this folder is on sys.path
    import report

WORDS = "the a cat sat on mat of time every effort moves you language model tensor flow".split()
ENGINES = {"local, --workers 2": ["--workers", "2"],
           "beam, DirectRunner, 2 processes": ["--engine", "beam", "--", "--runner", "DirectRunner",
                                               "--direct_num_workers", "2", "--direct_running_mode",
                                               "multi_processing"]}


def write_prompts(path, count, seed=0):
    """`count` prompts of 4 to 20 words (two length buckets) as a JSONL file."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": " ".join(rng.choice(WORDS, rng.integers(4, 21)))}) + "\n")


def rows(output):
    """{line: row} of an output: the local engine's file or Beam's shards."""
    files = glob.glob(output + "-*-of-*") or [output]
    return {row["line"]: row for f in files for row in map(json.loads, open(f, encoding="utf-8"))}


def timed(command, output):
    """Seconds the command took, and its rows; raises where it fails."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return took, rows(output)


def benchmark(model_dir, folder, *, prompts, length, batch_size, runs):
    """{engine: [seconds of each run]} and whether every run wrote the same rows."""
    source = os.path.join(folder, "in.jsonl")
    write_prompts(source, prompts)
    base = [sys.executable, "-m", "tfgpt2_cli", "generate-batch", "--model_dir", model_dir, "--input", source,
            "--length", str(length), "--batch_size", str(batch_size), "--seed", "1", "--top_k", "40", "--quiet"]
    seconds, outputs = {name: [] for name in ENGINES}, []
    for run in range(runs):
        for k, (name, flags) in enumerate(ENGINES.items()):
            output = os.path.join(folder, f"out-{run}-{k}")
            took, written = timed(base + ["--output", output] + flags, output)  # Beam's options last, after --
            seconds[name].append(took)
            outputs.append(written)
    return seconds, all(o == outputs[0] for o in outputs) and len(outputs[0]) == prompts


COLUMNS = [report.column("engine", "engine"), report.column("rows_per_s", "rows/s", ".2f"),
           report.column("seconds", "seconds", ".1f"), report.column("vs_local", "rows/s vs local", ".2f")]


def tables(seconds, prompts):
    """The report's table: each engine's rows/s and seconds, and its rows/s over the local engine's."""
    local = np.median([prompts / s for s in seconds[next(iter(ENGINES))]])
    rows_ = [{"engine": name, "rows_per_s": report.spread([prompts / s for s in times]),
              "seconds": report.spread(times), "vs_local": np.median([prompts / s for s in times]) / local}
             for name, times in seconds.items()]
    return [report.table(COLUMNS, rows_, "Bulk generation, whole commands")]


NUMBERS = {"prompts": (128, "prompts in the input (4 to 20 words each)"), "length": (32, "new tokens per prompt"),
           "batch_size": (8, "generate-batch's --batch_size"), "runs": (3, "runs of each engine")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="a model folder (default: a 124M-shaped one, std 0.1, made here)")
    for name, (default, text) in NUMBERS.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{text} (default {default})")
    args = report.add_arguments(parser, "beam").parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tfgpt2-beam-bench-") as tmp:
        model_dir = args.model_dir or make_checkpoint(os.path.join(tmp, "124M"), published_hparams("124M"), std=0.1)
        seconds, same = benchmark(model_dir, tmp, prompts=args.prompts, length=args.length,
                                  batch_size=args.batch_size, runs=args.runs)
    if not same:
        sys.exit("error: the engines wrote different rows")
    notes = [f"{args.prompts} prompts of 4 to 20 words (two length buckets), {args.length} new tokens each (top_k "
             f"40, seed 1), batches of {args.batch_size}; each run a whole command in a fresh process (start-up, "
             f"loading and compiling included), the engines alternating, {args.runs} runs each (median and range). "
             "Every run wrote the same rows.",
             "Weights: random, 124M-shaped (std 0.1), made by the tool." if not args.model_dir else
             f"Model: {args.model_dir}."]
    settings = {k: getattr(args, k) for k in ("model_dir", *NUMBERS)}
    found = tables(seconds, args.prompts)
    beam = next(r for r in found[0]["rows"] if r["engine"].startswith("beam"))
    report.publish(args, "Bulk generation: Apache Beam against the local engine", found,
                   tool=__file__, argv=argv, settings=settings, notes=notes,
                   headlines=[{"what": "generate-batch --engine beam (DirectRunner, 2 processes) vs --workers 2",
                                "figure": f"{beam['rows_per_s']['median']:.2f} rows/s, {beam['vs_local']:.2f}x the "
                                          "local engine's"}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
