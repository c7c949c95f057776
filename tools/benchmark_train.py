#!/usr/bin/env python3
"""Training speed of tfgpt2 against KerasHub's `GPT2CausalLM.fit` and HF transformers (PyTorch).

    tfgpt2 make-checkpoint 124M          # a model folder (random weights train at the same speed)
    python tools/benchmark_train.py --model_dir models/124M --batch 4 --length 128

Each candidate runs in a fresh process of its own, one after another, with the model's shape
(`--model_dir`'s hparams: tfgpt2 loads that checkpoint; KerasHub and transformers, where
installed, get random weights of the same shape, without dropout), Adam, float32, on random
token batches of `--batch` x `--length` predicted tokens (`--precision`, `--remat`, `--no_xla`,
`--optimizer`, `--accumulate`: tfgpt2's, as `tfgpt2.train` takes them; candidate
tfgpt2-float32 is tfgpt2 in float32 with XLA, `tfgpt2.train`'s default, beside them in the same
run). Per candidate: tokens per second (of each of `--steps` steps after `--warmup` steps:
the median and range), the first step's time (compilation included) and the process's peak
resident memory (VmHWM); model GFLOP/s is tokens/s times the products' work per token
(`flops_per_token`, without what `--remat` recomputes), to set against the machine's product
rate (`tools/benchmark_matmul.py`). With `--repeats N` the candidates take turns N times:
tokens/s over the steps of all N processes, the other figures over the N processes.
Candidate tfgpt2-lora is tfgpt2 training LoRA adapters of `--lora_rank` alone (`tfgpt2 train
--lora_rank`, the default targets), with the same options; the report adds, computed from the
shape, what a step holds on a GPU (weights, gradients, optimizer state, activations) for full
fine-tuning and for LoRA. transformers runs under `$TFGPT2_HF_PYTHON` where set (a Python with torch and transformers;
they need not share tfgpt2's environment). The report (tools/report.py) goes to
`--report DIR` as `--name`.json and .md (default train).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

try:
    from . import report
except ImportError:  # run as `python tools/benchmark_train.py`: this folder is on sys.path
    import report

WORKERS = ["tfgpt2", "keras-hub", "transformers"]
CANDIDATES = WORKERS + ["tfgpt2-float32", "tfgpt2-lora"]  # tfgpt2's worker at float32 with XLA; with LoRA


def peak_rss_mb():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


def batches(args, n_vocab, rows=None):
    rng = np.random.default_rng(0)
    return [rng.integers(0, n_vocab, [rows or args.batch, args.length + 1]).astype(np.int32)
            for _ in range(args.warmup + args.steps)]


def flops_per_token(hparams, length, lora=False):
    """Multiply-adds x 2 of a training step per predicted token: forward, input gradient and
    weight gradient (3 x 2 per weight; with `lora`, frozen weights, no weight gradient: 2 x 2,
    the adapters' own work left out) of the blocks' and the output layer's products, and
    attention's two products over `length` positions (all of them, as the implementations
    compute them, masked or not)."""
    n_embd, n_layer = hparams["n_embd"], hparams["n_layer"]
    weights = n_layer * 12 * n_embd * n_embd + hparams["n_vocab"] * n_embd
    return (4 if lora else 6) * weights + 3 * n_layer * 2 * 2 * length * n_embd


def lora_parameters(hparams, rank):
    """Adapters of `rank` on each block's c_attn (tfgpt2's default targets): a [n_embd, rank],
    b [rank, 3 n_embd]."""
    return hparams["n_layer"] * rank * 4 * hparams["n_embd"]


def gpu_accounting(hparams, length, rank):
    """What a training step of one row of `length` tokens holds, float32, Adam, --remat, by
    kind (bytes), for full fine-tuning and for LoRA of `rank`; computed from the shape, not
    measured. Activations: each block's input (kept by --remat), one block recomputed in the
    backward pass (its inputs to the products, q/k/v, the MLP's 4 n_embd twice, the attention
    scores, probabilities and their gradient) and the logits with their gradient."""
    n_embd, n_layer, n_head = hparams["n_embd"], hparams["n_layer"], hparams["n_head"]
    weights = n_layer * (12 * n_embd * n_embd + 13 * n_embd) + (hparams["n_vocab"] + hparams["n_ctx"] + 2) * n_embd
    block = length * n_embd * (2 + 3 + 1 + 2 * 4) + 3 * n_head * length * length
    activations = n_layer * length * n_embd + block + 2 * length * hparams["n_vocab"]
    adapters = lora_parameters(hparams, rank)
    rows = []
    for name, trained in [("full fine-tuning", weights), (f"LoRA rank {rank}", adapters)]:
        parts = {"weights": weights + (adapters if trained == adapters else 0), "gradients": trained,
                 "optimizer_state": 2 * trained, "activations": activations}
        parts = {key: 4 * n for key, n in parts.items()}
        rows.append({"training": name, **{key: n / 2**30 for key, n in parts.items()},
                     "total": sum(parts.values()) / 2**30})
    return rows


def time_steps(step, data):
    """Seconds of each call step(batch)."""
    seconds = []
    for batch in data:
        start = time.perf_counter()
        step(batch)
        seconds.append(time.perf_counter() - start)
    return seconds


def run_tfgpt2(args):
    import tensorflow as tf
    import keras
    from tfgpt2 import load_model
    from tfgpt2.train.optimizers import make_optimizer
    from tfgpt2.train.step import Trainer
    from tfgpt2.train.step import prefer_memory_schedule
    if args.remat:
        prefer_memory_schedule()  # as tfgpt2 train --remat does
    model = load_model(args.model_dir, dtype=args.precision, remat=args.remat)
    if args.lora:
        model.enable_lora(args.lora_rank, seed=0)  # only the adapters train
    optimizer = make_optimizer(args.optimizer, 2e-5)
    if args.precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    trainer = Trainer(model, optimizer, accumulate=args.accumulate, jit_compile=not args.no_xla)
    data = batches(args, model.hparams.n_vocab, rows=args.accumulate * args.batch)
    return time_steps(lambda b: float(trainer.step(tf.constant(b))), data)


def run_keras_hub(args):
    import keras
    import keras_hub
    from tfgpt2.hparams import load_hparams
    hp = load_hparams(args.model_dir)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=hp.n_vocab, num_layers=hp.n_layer, num_heads=hp.n_head, hidden_dim=hp.n_embd,
        intermediate_dim=4 * hp.n_embd, max_sequence_length=hp.n_ctx, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(2e-5, epsilon=1e-8),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    mask = np.ones([args.batch, args.length], bool)
    return time_steps(lambda b: model.train_on_batch({"token_ids": b[:, :-1], "padding_mask": mask}, b[:, 1:]),
                      batches(args, hp.n_vocab))


def run_transformers(args):
    import torch
    import transformers
    with open(os.path.join(args.model_dir, "hparams.json")) as f:  # no tfgpt2 (TensorFlow) here
        hp = argparse.Namespace(**json.load(f))
    config = transformers.GPT2Config(vocab_size=hp.n_vocab, n_positions=hp.n_ctx, n_embd=hp.n_embd,
                                     n_layer=hp.n_layer, n_head=hp.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-5, eps=1e-8)

    def step(batch):
        batch = torch.from_numpy(batch.astype(np.int64))
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time_steps(step, batches(args, hp.n_vocab))


def worker(args):
    seconds = {"tfgpt2": run_tfgpt2, "keras-hub": run_keras_hub, "transformers": run_transformers}[args.worker](args)
    timed = seconds[args.warmup:]
    tokens = args.accumulate * args.batch * args.length
    ours = args.worker == "tfgpt2"
    print(json.dumps({"tokens_per_s": tokens / float(np.median(timed)), "tokens_per_step": tokens,
                      "step_s": timed, "first_step_s": seconds[0], "peak_rss_mb": peak_rss_mb(),
                      "precision": args.precision if ours else "float32",
                      "xla": (not args.no_xla) if ours else args.worker == "keras-hub",
                      "lora_rank": args.lora_rank if args.lora else None}))


def hf_python():
    """The Python that runs PyTorch: `$TFGPT2_HF_PYTHON` where set, else this one."""
    return os.environ.get("TFGPT2_HF_PYTHON", sys.executable)


def has_modules(python, *modules):
    check = "import importlib.util, sys; sys.exit(not all(importlib.util.find_spec(m) for m in sys.argv[1:]))"
    return subprocess.run([python, "-c", check, *modules]).returncode == 0


def python_for(candidate):
    return hf_python() if candidate == "transformers" else sys.executable


def installed(candidate):
    needs = {"keras-hub": ["keras_hub"], "transformers": ["torch", "transformers"]}.get(candidate, [])
    return has_modules(python_for(candidate), *needs)


def run_worker(candidate, args):
    """The worker's figures, or the last line of its error. tfgpt2-float32 is tfgpt2 with
    `tfgpt2.train`'s default precision and compilation (float32, XLA), tfgpt2-lora is tfgpt2 with
    LoRA of --lora_rank, the other options as given."""
    if candidate == "tfgpt2-float32":
        candidate, args = "tfgpt2", argparse.Namespace(**dict(vars(args), precision="float32", no_xla=False))
    lora = candidate == "tfgpt2-lora"
    candidate = "tfgpt2" if lora else candidate
    argv = [python_for(candidate), __file__, "--worker", candidate] + [
        x for k in ("model_dir", "batch", "length", "steps", "warmup", "precision", "optimizer", "accumulate",
                    "lora_rank")
        for x in (f"--{k}", str(getattr(args, k)))] + ["--remat"] * args.remat + ["--no_xla"] * args.no_xla + [
        "--lora"] * lora
    out = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if out.returncode:
        return f"failed: {out.stderr.strip().splitlines()[-1:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def plural(n, one, many=None):
    return f"{n} {one if n == 1 else many or one + 's'}"


COLUMNS = [report.column("implementation", "implementation"), report.column("setup", "setup"),
           report.column("tokens_per_s", "tokens/s", ".0f"), report.column("gflops", "model GFLOP/s", ".1f"),
           report.column("first_step_s", "first step s", ".1f"), report.column("peak_rss_mb", "peak RSS MB", ".0f")]
ERROR = report.column("error", "error")
ACCOUNTING = [report.column("training", "training")] + [
    report.column(key, header, ".2f") for key, header in [("weights", "weights"), ("gradients", "gradients"),
                                                         ("optimizer_state", "Adam state"),
                                                         ("activations", "activations (remat)"), ("total", "total")]]


def row_of(candidate, runs, flops):
    """A candidate's row from its processes' figures (or the error of the first that failed);
    `flops`: (per token, per token with LoRA)."""
    failed = [r for r in runs if isinstance(r, str)]
    if failed:
        return {"implementation": candidate, "error": failed[0]}
    rates = [r["tokens_per_step"] / s for r in runs for s in r["step_s"]]
    first = runs[0]
    flops = flops[first.get("lora_rank") is not None]
    return {"implementation": candidate, "setup": first["precision"] + (", XLA" if first["xla"] else "")
            + (f", LoRA rank {first['lora_rank']}" if first.get("lora_rank") else ""),
            "tokens_per_s": report.spread(rates), "gflops": report.spread([t * flops / 1e9 for t in rates]),
            "first_step_s": report.spread([r["first_step_s"] for r in runs]),
            "peak_rss_mb": report.spread([r["peak_rss_mb"] for r in runs]),
            "tokens_per_step": first["tokens_per_step"], "processes": len(runs)}


def headlines_of(rows, args):
    """README rows: LoRA against full fine-tuning in one row where both ran, else one per
    tfgpt2 row; named by the model folder (models/355M: 355M)."""
    ok = {r["implementation"]: r for r in rows if "error" not in r and r["implementation"].startswith("tfgpt2")}
    shape = f"{os.path.basename(os.path.normpath(args.model_dir))}, batch {args.batch} x {args.length}"

    def median(row, key, fmt):
        return format(row[key]["median"], fmt)
    if {"tfgpt2", "tfgpt2-lora"} <= set(ok):
        lora, full = ok["tfgpt2-lora"], ok["tfgpt2"]
        return [{"what": f"fine-tuning {shape}, LoRA rank {args.lora_rank} against every weight "
                         f"({full['setup']}, {args.optimizer}{', remat' * args.remat})",
                 "figure": f"peak RSS {median(lora, 'peak_rss_mb', ',.0f')} against "
                           f"{median(full, 'peak_rss_mb', ',.0f')} MB, {median(lora, 'tokens_per_s', '.0f')} "
                           f"against {median(full, 'tokens_per_s', '.0f')} tokens/s"}]
    return [{"what": f"fine-tuning {shape}, {name} ({r['setup']})",
             "figure": f"{median(r, 'tokens_per_s', '.0f')} tokens/s, peak RSS {median(r, 'peak_rss_mb', ',.0f')} MB"}
            for name, r in ok.items()]


def arguments(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default="models/124M", help="a model folder (tfgpt2 make-checkpoint 124M)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128, help="predicted tokens per row (the model reads as many)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="processes per candidate, taking turns")
    p.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=WORKERS,
                   help="tfgpt2-float32: tfgpt2 in float32 with XLA, the baseline for --precision and --no_xla "
                        "in the same run")
    p.add_argument("--precision", choices=("float32", "mixed_bfloat16", "mixed_float16"), default="float32",
                   help="tfgpt2's dtype policy (as tfgpt2 train --precision); the others run in float32")
    p.add_argument("--remat", action="store_true", help="tfgpt2 recomputes each block in the backward pass")
    p.add_argument("--optimizer", choices=("adam", "adafactor"), default="adam", help="tfgpt2's optimizer")
    p.add_argument("--no_xla", action="store_true", help="tfgpt2's step as a plain tf.function (as tfgpt2 train --no_xla)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="tfgpt2 averages the gradients of this many micro-batches of --batch rows per step "
                        "(as tfgpt2 train --accumulate_gradients); tokens/s counts them all")
    p.add_argument("--lora_rank", type=int, default=8, help="tfgpt2-lora's rank (as tfgpt2 train --lora_rank)")
    report.add_arguments(p, "train")
    p.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    p.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.accumulate > 1 and not args.worker and set(args.candidates) - {"tfgpt2", "tfgpt2-float32"}:
        p.error("--accumulate is tfgpt2's alone: add --candidates tfgpt2")
    return args


def measure(args, flops):
    """Each installed candidate's runs, taking turns --repeats times: (the report's rows, the
    candidates measured, those not installed). `flops`: per token, without and with LoRA."""
    candidates, missing = [], []
    for candidate in args.candidates:
        (candidates if installed(candidate) else missing).append(candidate)
    results = {c: [] for c in candidates}
    for _ in range(args.repeats):
        for candidate in candidates:
            print(f"measuring {candidate} ...", file=sys.stderr, flush=True)
            results[candidate].append(run_worker(candidate, args))
    return [row_of(candidate, runs, flops) for candidate, runs in results.items()], candidates, missing


def notes_of(args, hparams, candidates, missing, flops):
    """The report's notes: the setup, how the figures are made, LoRA's adapters, what is not installed."""
    (flops, lora_flops), others = flops, [c for c in candidates if not c.startswith("tfgpt2")]
    options = "".join([" remat" * args.remat, " without XLA" * args.no_xla,
                       f" accumulating {args.accumulate} micro-batches" * (args.accumulate > 1)])
    notes = [f"Training steps on batches of {args.batch} x {args.length} predicted tokens; tfgpt2: "
             f"{args.optimizer}, {args.precision}{options}" + ("; the others: Adam, float32. " if others else ". ")
             + f"Tokens/s of each of {plural(args.steps, 'step')} after {plural(args.warmup, 'warm-up step')}, "
             f"in {plural(args.repeats, 'process', 'processes')} per implementation (median and range); model "
             f"GFLOP/s: tokens/s x {flops / 1e6:.0f} MFLOP per token (the products' work; with LoRA "
             f"{lora_flops / 1e6:.0f}, no weight gradients); first step: "
             f"compilation included; peak RSS: the process's peak resident set."]
    if "tfgpt2-lora" in candidates:
        notes.append(f"tfgpt2-lora: adapters of rank {args.lora_rank} on each block's c_attn "
                     f"({lora_parameters(hparams, args.lora_rank):,} parameters), every other weight frozen. "
                     "On a GPU (computed, not measured): a step of one row of --length tokens, float32, Adam, "
                     "--remat, holds the GiB of the second table.")
    if missing:
        notes.append(f"Not installed here: {', '.join(missing)}.")
    return notes


def main(argv=None):
    args = arguments(argv)
    if args.worker:
        return worker(args)
    with open(os.path.join(args.model_dir, "hparams.json")) as f:
        hparams = json.load(f)
    flops = flops_per_token(hparams, args.length), flops_per_token(hparams, args.length, lora=True)
    rows, candidates, missing = measure(args, flops)
    settings = {k: getattr(args, k) for k in ("model_dir", "batch", "length", "steps", "warmup", "repeats",
                                              "candidates", "precision", "remat", "optimizer", "no_xla",
                                              "accumulate", "lora_rank")}
    settings["flops_per_token"], settings["lora_flops_per_token"] = flops
    columns = COLUMNS + [ERROR] * any("error" in r for r in rows)
    tables = [report.table(columns, rows)]
    if "tfgpt2-lora" in candidates:
        tables.append(report.table(ACCOUNTING, gpu_accounting(hparams, args.length, args.lora_rank),
                                   title=f"On a GPU, computed: GiB held by a step of 1 x {args.length} tokens"))
    report.publish(args, "Fine-tuning speed", tables, tool=__file__, argv=argv, settings=settings,
                   notes=notes_of(args, hparams, candidates, missing, flops), headlines=headlines_of(rows, args))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
