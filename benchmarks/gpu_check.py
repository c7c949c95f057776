#!/usr/bin/env python3
"""GPU readiness in a few minutes: the model's numbers on the GPU against the CPU, then its speed.

    benchmarks/gpu_check.sh                                  # the usual way (checks nvidia-smi first)
    python benchmarks/gpu_check.py [--model_dir models/124M]
    python benchmarks/gpu_check.py --cpu-only --model_dir DIR --short 8 --long 16 --train_length 16

On 124M-shaped random weights (std 0.1, made in a temporary folder unless `--model_dir`):

- logits of a [2, 128] token batch on the GPU, under XLA and without, against the CPU without
  XLA, float32 with TensorFloat-32 off: max |difference| <= `--atol` (5e-4);
- greedy tokens (top_k 1) of `tfgpt2.generate` on the GPU against the CPU: identical;
- decode ms/token at batch 1 and 8, float32 and bfloat16 (`tfgpt2.generate`, XLA): the
  difference between generating `--long` and `--short` new tokens after a 1-token prompt (one
  length bucket, so one compiled program), per pair of runs, median and range of `--runs`;
- training step tokens/s at `--train_batch` x `--train_length`, float32 and mixed_bfloat16
  (`tfgpt2.train.step.Trainer`, Adam, XLA): each of `--steps` steps after two warm-up ones.

The report (benchmarks/report.py) goes to `--report DIR` as `--name`.json and .md (default
gpu-check). Where TensorFlow sees no GPU it says so and exits 0 without checking anything.
`--cpu-only` runs the same steps with the CPU as the device (a dry run of this script's logic,
report cpu-dry-run): the figures then say nothing about a GPU. The exit status is 1 where a
check fails.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from . import report
except ImportError:  # run as `python benchmarks/gpu_check.py`: this folder is on sys.path
    import report


def no_gpu_message():
    """Why there is nothing to check, in a sentence."""
    listed = ""
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    if listed:
        return (f"TensorFlow sees no GPU, though nvidia-smi lists: {listed.splitlines()[0]}. Install TensorFlow "
                f"with CUDA (pip install 'tensorflow[and-cuda]') and check `python -c \"import tensorflow as tf; "
                f"print(tf.config.list_physical_devices('GPU'))\"`. Nothing checked.")
    return "No GPU visible (TensorFlow lists none, nvidia-smi none): nothing checked. --cpu-only runs a dry run."


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- the checks ---------------------------------------------------------------------------

def logits_check(model_dir, device, tokens):
    """max |logits on `device` - logits on the CPU|, under XLA and without (float32)."""
    import tensorflow as tf
    from tfgpt2 import load_model
    with tf.device("/CPU:0"):
        cpu = load_model(model_dir)
        expected = cpu(tf.constant(tokens))["logits"].numpy()
    del cpu
    with tf.device(device):
        model = load_model(model_dir)
        eager = model(tf.constant(tokens))["logits"].numpy()
        xla = tf.function(lambda x: model(x)["logits"], jit_compile=True)(tf.constant(tokens)).numpy()
    return {"xla": float(np.max(np.abs(xla - expected))), "eager": float(np.max(np.abs(eager - expected))),
            "scale": float(np.max(np.abs(expected)))}


def greedy_check(model_dir, device, prompts, length):
    """(tokens identical?, index of the first difference in the first row that differs or None)."""
    import tensorflow as tf
    from tfgpt2 import generate, load_model
    found = {}
    for where in ("/CPU:0", device):
        with tf.device(where):
            model = load_model(model_dir)
            found[where] = generate(model, prompts, length, top_k=1, seed=0)
    for row_cpu, row_device in zip(found["/CPU:0"], found[device]):
        if len(row_cpu) != len(row_device) or (row_cpu != row_device).any():
            n = min(len(row_cpu), len(row_device))
            different = np.nonzero(row_cpu[:n] != row_device[:n])[0]
            return False, int(different[0]) if len(different) else n
    return True, None


def decode_speed(model_dir, device, dtype, batches, *, short, long, runs):
    """{batch: [s per token of each pair of runs], "first_s": ...} for `dtype` on `device`."""
    import tensorflow as tf
    from tfgpt2 import generate, load_model
    found = {}
    with tf.device(device):
        model = load_model(model_dir, dtype=dtype)
        for batch in batches:
            prompts = [[1]] * batch

            def run(n):
                return lambda: generate(model, prompts, n, seed=0)
            first = timed(run(long)) + timed(run(short))  # compiles (one program: one bucket)
            pairs = [(timed(run(long)), timed(run(short))) for _ in range(runs)]
            found[batch] = {"first_s": first, "per_token_s": [(lg - sh) / (long - short) for lg, sh in pairs]}
    return found


def train_speed(model_dir, device, precision, *, batch, length, steps):
    """(seconds of each of `steps` steps after two warm-up ones, first step's seconds)."""
    import tensorflow as tf
    from tfgpt2 import load_model
    from tfgpt2.train.optimizers import make_optimizer
    from tfgpt2.train.step import Trainer
    with tf.device(device):
        model = load_model(model_dir, dtype=precision)
        trainer = Trainer(model, make_optimizer("adam", 2e-5))
        rng = np.random.default_rng(0)
        data = [tf.constant(rng.integers(0, model.hparams.n_vocab, [batch, length + 1]), tf.int32)
                for _ in range(steps + 2)]
        seconds = [timed(lambda b=b: float(trainer.step(b))) for b in data]
    return seconds[2:], seconds[0]


# ---- the report ---------------------------------------------------------------------------

CHECKS = [report.column("check", "check"), report.column("value", "value", ".3g"),
          report.column("limit", "limit"), report.column("ok", "ok")]
DECODE = [report.column("dtype", "dtype"), report.column("batch", "batch"),
          report.column("ms_per_token", "decode ms/token", ".2f"), report.column("tokens_per_s", "tokens/s", ".0f"),
          report.column("first_s", "first calls s", ".1f")]
TRAIN = [report.column("precision", "precision"), report.column("shape", "batch x length"),
         report.column("tokens_per_s", "tokens/s", ".0f"), report.column("first_step_s", "first step s", ".1f")]


def device_name(device):
    import tensorflow as tf
    if device.startswith("/CPU"):
        return "the CPU (dry run)"
    gpus = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
    return details.get("device_name", device)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", help="a model folder (default: 124M-shaped random weights, std 0.1, made here)")
    p.add_argument("--cpu-only", dest="cpu_only", action="store_true",
                   help="a dry run with the CPU as the device (this script's logic, no GPU figures)")
    p.add_argument("--atol", type=float, default=5e-4, help="the logits' tolerance (float32)")
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens compared")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--short", type=int, default=130)
    p.add_argument("--long", type=int, default=190, help="decode lengths; 1 + each in one bucket (192 for the defaults)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--train_batch", type=int, default=8)
    p.add_argument("--train_length", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    report.add_arguments(p, "gpu-check")
    args = p.parse_args(argv)
    if args.cpu_only and args.name == "gpu-check":
        args.name = "cpu-dry-run"

    import tensorflow as tf
    if args.cpu_only:
        device = "/CPU:0"
    elif tf.config.list_physical_devices("GPU"):
        device = "/GPU:0"
    else:
        print(no_gpu_message(), file=sys.stderr)
        return 0
    # float32 means float32: no TensorFloat-32 products (on by default on Ampere and later)
    tf.config.experimental.enable_tensor_float_32_execution(False)

    with tempfile.TemporaryDirectory(prefix="tfgpt2-gpu-check-") as tmp:
        model_dir = args.model_dir
        if not model_dir:
            from tfgpt2.hparams import published_hparams
            from tfgpt2.testing.checkpoints import make_checkpoint
            print("writing 124M-shaped random weights ...", file=sys.stderr, flush=True)
            model_dir = make_checkpoint(os.path.join(tmp, "124M"), published_hparams("124M"), std=0.1)
        from tfgpt2 import load_hparams
        hp = load_hparams(model_dir)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, hp.n_vocab, [2, min(hp.n_ctx, 128)]).astype(np.int32)

        print("logits ...", file=sys.stderr, flush=True)
        logits = logits_check(model_dir, device, tokens)
        print("greedy tokens ...", file=sys.stderr, flush=True)
        prompts = rng.integers(0, hp.n_vocab, [2, 8]).tolist()
        same, first_difference = greedy_check(model_dir, device, prompts, args.greedy)
        checks = [
            {"check": "max |logits - CPU's|, XLA", "value": logits["xla"], "limit": f"<= {args.atol:g}",
             "ok": logits["xla"] <= args.atol},
            {"check": "max |logits - CPU's|, without XLA", "value": logits["eager"], "limit": f"<= {args.atol:g}",
             "ok": logits["eager"] <= args.atol},
            {"check": "max |logits| (scale)", "value": logits["scale"], "limit": "", "ok": None},
            {"check": f"greedy tokens ({args.greedy}, 2 rows) equal the CPU's", "value": None,
             "limit": "identical", "ok": same, "first_difference": first_difference},
        ]

        decode_rows = []
        for dtype in ("float32", "bfloat16"):
            print(f"decode speed, {dtype} ...", file=sys.stderr, flush=True)
            found = decode_speed(model_dir, device, dtype, args.batch, short=args.short, long=args.long,
                                 runs=args.runs)
            for batch, f in found.items():
                decode_rows.append({"dtype": dtype, "batch": batch,
                                    "ms_per_token": report.spread([s * 1e3 for s in f["per_token_s"]]),
                                    "tokens_per_s": report.spread([batch / s for s in f["per_token_s"]]),
                                    "first_s": f["first_s"]})
        train_rows = []
        for precision in ("float32", "mixed_bfloat16"):
            print(f"training speed, {precision} ...", file=sys.stderr, flush=True)
            seconds, first = train_speed(model_dir, device, precision, batch=args.train_batch,
                                         length=args.train_length, steps=args.steps)
            tokens_per_step = args.train_batch * args.train_length
            train_rows.append({"precision": precision, "shape": f"{args.train_batch} x {args.train_length}",
                               "tokens_per_s": report.spread([tokens_per_step / s for s in seconds]),
                               "first_step_s": first})

    ok = all(c["ok"] is not False for c in checks)
    where = device_name(device)
    notes = [f"Device: {where}, against the CPU. Weights: {'random, 124M-shaped (std 0.1)' if not args.model_dir else args.model_dir}. "
             f"float32 with TensorFloat-32 off. Decode: `tfgpt2.generate` (XLA), {args.long} and {args.short} "
             f"new tokens after a 1-token prompt, per pair of runs, median and range of {args.runs}; first calls: "
             f"both lengths' first calls, compilation included. Training: Adam steps (`Trainer`, XLA), "
             f"{args.steps} after two warm-up ones. Checks: {'all passed' if ok else 'FAILED'}."]
    if args.cpu_only:
        notes.insert(0, "Dry run on the CPU (--cpu-only): the script's logic, no GPU figures.")
    settings = {k: getattr(args, k) for k in ("model_dir", "cpu_only", "atol", "greedy", "batch", "short", "long",
                                              "runs", "train_batch", "train_length", "steps")}
    settings.update(device=device, device_name=where, checks_passed=ok)
    headlines = [{"what": f"GPU decode, batch {r['batch']}, {r['dtype']}", "figure": f"{r['ms_per_token']['median']:.2f} ms/token"}
                 for r in decode_rows if not args.cpu_only]
    title = "GPU check" if not args.cpu_only else "GPU check (dry run on the CPU)"
    report.publish(args, title, [report.table(CHECKS, checks, "Numbers against the CPU"),
                                 report.table(DECODE, decode_rows, "Decoding"),
                                 report.table(TRAIN, train_rows, "Training step")],
                   tool=__file__, argv=argv, settings=settings, notes=notes, headlines=headlines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
