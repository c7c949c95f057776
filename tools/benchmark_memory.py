#!/usr/bin/env python3
"""Memory as this machine, its allocator and XLA's version give it: figures the tests leave to
this report (they check the behaviour behind each: tests/test_checkpoint.py, test_train.py,
test_remat.py).

- load: the peak resident memory that `tfgpt2.load_model` adds, in float32 and in bfloat16,
  against the size of the float32 weights (1.0: one float32 copy). Tensors are read a block
  of rows at a time and cast as read, so no second copy (nor a float32 `wte` beside a
  bfloat16 model) should show.
- accumulate: the peak of an Adam step without XLA of 2 micro-batches against one of 1, as
  sets of gradients more (the sums, kept in variables, are one set).
- remat: the bytes XLA allocates for a compiled Adam step on 1 x n_ctx tokens (its own buffer
  assignment, with the memory-minimizing scheduler), without and with `remat`.

Each figure is the median (and range) of `--runs` fresh processes (a peak's, processes of its
own; XLA's bytes, its own count of each compile, one set of processes for both). The shapes: load, 124M's
(random weights written to a temporary folder, or `--model_dir`); accumulate, 2 blocks of
width 256 on windows of 33 tokens (the gradients, mostly `wte`'s, dominate); remat, 6 blocks
of width 64 on 512 tokens (the activations dominate); `--hparams` sets one shape for all.
Linux only (/proc/self/status). The report (tools/report.py) goes to `--report DIR` as
`--name`.json and .md (default memory).

    python tools/benchmark_memory.py
    python tools/benchmark_memory.py --model_dir models/124M --runs 5
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

try:
    from . import report
except ImportError:  # run as `python tools/benchmark_memory.py`: this folder is on sys.path
    import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD_HPARAMS = dict(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)
ACCUMULATE_HPARAMS = dict(n_vocab=50257, n_ctx=64, n_embd=256, n_head=4, n_layer=2)
REMAT_HPARAMS = dict(n_vocab=512, n_ctx=512, n_embd=64, n_head=4, n_layer=6)

STATUS = """
import re
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
"""
LOAD = STATUS + """
import sys
from tfgpt2 import count_params, load_model
before = status("VmRSS")
model = load_model(sys.argv[1], dtype=sys.argv[2])
print(status("VmHWM") - before, count_params(model) * 4)
"""
STEP = """
import json, sys, numpy as np, tensorflow as tf
from tfgpt2 import GPT2
from tfgpt2.hparams import default_hparams
from tfgpt2.train.optimizers import make_optimizer
from tfgpt2.train.step import Trainer
hparams = default_hparams().override_from_dict(json.loads(sys.argv[1]))
def step(rows, length, **options):
    model = GPT2(hparams, remat=options.pop("remat", False))
    tokens = tf.constant(np.random.default_rng(0).integers(0, hparams.n_vocab, size=[rows, length]), tf.int32)
    float(Trainer(model, make_optimizer("adam", 1e-3), **options).step(tokens))
    return model
"""
ACCUMULATE = STATUS + STEP + """
tf.config.threading.set_inter_op_parallelism_threads(1)  # ops side by side made the peak vary by a `wte`
accumulate = int(sys.argv[2])
model = step(accumulate, min(33, hparams.n_ctx), accumulate=accumulate, jit_compile=False)
print(status("VmHWM"), sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables))
"""
REMAT = STEP + """
import glob, os, re
found, seen = [], set()
for remat in (False, True):  # each step compiles afresh: its reports are those written since the last
    step(1, hparams.n_ctx, remat=remat)
    reports = set(glob.glob(os.path.join(sys.argv[2], "*memory-usage-report.txt"))) - seen
    found.append(max(int(re.search(r"Total bytes used: (\\d+)", open(f).read()).group(1)) for f in reports))
    seen |= reports
print(*found)
"""


def child(script, *args, env=None):
    """The numbers the last line of `script`'s output holds, run in a fresh process."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if done.returncode:
        sys.exit(f"a measuring process failed:\n{done.stderr[-3000:]}")
    return [int(n) for n in done.stdout.strip().splitlines()[-1].split()]


def measure_load(model_dir, runs):
    """{dtype: (peak MB runs, ratio-to-float32-weights runs)}."""
    found = {}
    for dtype in ("float32", "bfloat16"):
        pairs = [child(LOAD, model_dir, dtype) for _ in range(runs)]
        found[dtype] = ([p / 1e6 for p, _ in pairs], [p / w for p, w in pairs])
    return found


def measure_accumulate(hparams, runs):
    """(peak MB runs with 1 micro-batch, with 2, sets of gradients more per run)."""
    one, two = ([child(ACCUMULATE, json.dumps(hparams), n) for _ in range(runs)] for n in (1, 2))
    return [p / 1e6 for p, _ in one], [p / 1e6 for p, _ in two], [(b - a) / g for (a, g), (b, _) in zip(one, two)]


def measure_remat(hparams, runs):
    """(XLA's MB runs without remat, with it, ratio per run): XLA counts each compile's buffers
    alone, so one process per run compiles both steps."""
    found = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as dump:
            flags = f"--xla_cpu_enable_concurrency_optimized_scheduler=false --xla_dump_to={dump} " \
                    "--xla_dump_hlo_pass_re=NONE"
            found.append(child(REMAT, json.dumps(hparams), dump, env=dict(XLA_FLAGS=flags, TF_XLA_FLAGS="")))
    return [p / 1e6 for p, _ in found], [r / 1e6 for _, r in found], [r / p for p, r in found]


def rows(load, accumulate, remat):
    """The table's rows: each figure's spread over the runs, and its ratio where it has one."""
    s = report.spread
    return [
        {"measure": "load_model", "setting": "float32", "mb": s(load["float32"][0]), "relative": s(load["float32"][1]),
         "to": "the float32 weights"},
        {"measure": "load_model", "setting": "bfloat16", "mb": s(load["bfloat16"][0]),
         "relative": s(load["bfloat16"][1]), "to": "the float32 weights"},
        {"measure": "Adam step without XLA", "setting": "1 micro-batch", "mb": s(accumulate[0])},
        {"measure": "Adam step without XLA", "setting": "2 micro-batches", "mb": s(accumulate[1]),
         "relative": s(accumulate[2]), "to": "sets of gradients more than 1 micro-batch"},
        {"measure": "XLA's bytes for an Adam step", "setting": "without remat", "mb": s(remat[0])},
        {"measure": "XLA's bytes for an Adam step", "setting": "remat", "mb": s(remat[1]),
         "relative": s(remat[2]), "to": "without remat"},
    ]


COLUMNS = [report.column("measure", "measure"), report.column("setting", "setting"),
           report.column("mb", "peak MB", ",.0f"), report.column("relative", "relative", ".2f"),
           report.column("to", "relative to")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="the model to load (default: random weights of the load shape)")
    parser.add_argument("--hparams", type=json.loads, help="one shape (a JSON object of hparams) for every measure")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per figure (default 3)")
    report.add_arguments(parser, "memory")
    args = parser.parse_args(argv)
    shapes = {name: args.hparams or default for name, default in
              (("load", LOAD_HPARAMS), ("accumulate", ACCUMULATE_HPARAMS), ("remat", REMAT_HPARAMS))}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or write_model(os.path.join(tmp, "model"), shapes["load"])
        print("measuring load_model ...", file=sys.stderr, flush=True)
        load = measure_load(model_dir, args.runs)
    print("measuring accumulation ...", file=sys.stderr, flush=True)
    accumulate = measure_accumulate(shapes["accumulate"], args.runs)
    print("measuring remat ...", file=sys.stderr, flush=True)
    remat = measure_remat(shapes["remat"], args.runs)
    table = rows(load, accumulate, remat)
    headlines = [{"what": "load_model peak, bfloat16",
                  "figure": f"{table[1]['relative']['median']:.2f}x the float32 weights"},
                 {"what": "XLA's bytes for a train step with remat",
                  "figure": f"{table[5]['relative']['median']:.2f}x without"}]
    notes = [f"Median (min-max) of {args.runs} fresh processes per figure; peak MB: the resident memory a "
             "process added (load_model) or reached (a step), or XLA's own count (remat)."]
    settings = {"runs": args.runs, "model_dir": args.model_dir, **{f"{k}_hparams": v for k, v in shapes.items()}}
    report.publish(args, "Memory", [report.table(COLUMNS, table)], tool=__file__, argv=argv, settings=settings,
                   notes=notes, headlines=headlines)
    return 0


def write_model(folder, hparams):
    """Random weights of `hparams`' shape in `folder` (as `tfgpt2 make-checkpoint`), in a process of its own."""
    child(f"from tfgpt2.testing.checkpoints import make_checkpoint\nfrom tfgpt2.hparams import default_hparams\n"
          f"make_checkpoint({folder!r}, default_hparams().override_from_dict({hparams!r}))\nprint(0)")
    return folder


if __name__ == "__main__":
    sys.exit(main())
