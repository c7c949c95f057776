#!/usr/bin/env python3
"""GPT-2 on an NVIDIA GPU as its users run it: the numbers against the CPU, decode and training
speed beside HF transformers on the same GPU in the same run, and the floor.

    tools/gpu_check.sh                     # the usual way: nvidia-smi, the quick tier, then this
    python tools/gpu_check.py [--model_dir models/124M] [--budget 480]
    python tools/gpu_check.py --cpu-only --model_dir DIR --batch 1 --short 4 --long 12 ...

On 124M-shaped random weights (std 0.1, made in a temporary folder unless `--model_dir`), each
stage in a child process of its own (its own TensorFlow or PyTorch, its own XLA_FLAGS). Children
start together but take the GPU one at a time (a lock on a file), so that no timing overlaps
another's work:

- checks: logits of a [2, 128] token batch on the GPU, under XLA and without, against the CPU
  without XLA, with TensorFlow's settings left at their defaults (TensorFloat-32 on, where the
  GPU has it): max |difference| <= `--atol` (5e-4); the same with the TF32 opt-in (`tf32=True`),
  reported, not checked; greedy tokens (top_k 1) of `tfgpt2.generate` on the GPU against the CPU:
  identical;
- decode: ms/token of `tfgpt2.generate` (XLA, temperature 1) after a 1-token prompt: the
  difference between generating `--long` and `--short` new tokens (one length bucket, so one
  compiled program), per pair of runs, median and range of `--runs`; first, batch 1 float32
  under each of `--variants` (XLA_FLAGS), then every `--batch` and dtype under the fastest;
- train: tokens/s of Adam steps (`tfgpt2.train.step.Trainer`, XLA) at `--train_batch` x
  `--train_length`, float32 and mixed_bfloat16, each of `--steps` steps after two warm-up ones,
  and the GPU's peak memory;
- hf: HF transformers' GPT2LMHeadModel (random weights of the same shape) on the same GPU under
  `--hf_python`: eager decode (`generate`), with `--hf_compile` also a static cache and
  `torch.compile`; training in float32 and under bfloat16 autocast (Adam, fused); and the
  measured device-to-device copy rate, which gives the floor: the weights' bytes over that rate
  is the least time a decode step can take at batch 1.

`tfgpt2 serve` on the GPU is measured by `tools/benchmark_serve.py` (its help gives the
GPU command), a report of its own.

The report (tools/report.py) goes to `--report DIR` as `--name`.json and .md (default
gpu-check). Where TensorFlow sees no GPU it says so and exits 0 without checking anything.
`--cpu-only` runs the TensorFlow stages in this process with the CPU as the device (a dry run of
the logic, report cpu-dry-run): its figures say nothing about a GPU. The exit status is 1 where
a check fails.
"""
import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from . import report
except ImportError:  # run as `python tools/gpu_check.py`: this folder is on sys.path
    import report

HERE = os.path.dirname(os.path.abspath(__file__))
# XLA_FLAGS tried for batch-1 decode: XLA's defaults, and command buffers (CUDA graphs) that also
# take in the while loop and its condition, so that a whole generation runs without a host round
# trip per token
VARIANTS = {
    "default": "",
    "graphs+while": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL "
                    "--xla_gpu_graph_min_graph_size=1",
}


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


def per_token_times(pairs, p):
    """Seconds per token from runs' (long, short) times: the long times less the short ones, each
    in order of speed (the fastest with the fastest), over the tokens between them, so that a
    slow spell of the host in one run does not fall on one side of a difference alone."""
    longs, shorts = (sorted(times) for times in zip(*pairs))
    return [(lg - sh) / (p["long"] - p["short"]) for lg, sh in zip(longs, shorts)]


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextlib.contextmanager
def gpu_turn(lock_path):
    """The GPU to this process alone while the block runs (None: no lock, a dry run)."""
    if lock_path is None:
        yield
        return
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---- the stages (each returns a JSON-able dict) ------------------------------------------------

def stage_checks(p):
    """Logits and greedy tokens on the device against the CPU, TensorFlow's settings untouched."""
    import tensorflow as tf
    from tfgpt2 import generate, load_hparams, load_model
    hp = load_hparams(p["model_dir"])
    rng = np.random.default_rng(0)
    tokens = tf.constant(rng.integers(0, hp.n_vocab, [2, min(hp.n_ctx, 128)]), tf.int32)
    prompts = rng.integers(0, hp.n_vocab, [2, 8]).tolist()
    with tf.device("/CPU:0"):
        cpu = load_model(p["model_dir"])
        expected = cpu(tokens)["logits"].numpy()
        cpu_greedy = generate(cpu, prompts, p["greedy"], top_k=1, seed=0)
    del cpu
    found = {"scale": float(np.max(np.abs(expected)))}
    with gpu_turn(p["lock"]), tf.device(p["device"]):
        for name, options in (("default", {}), ("tf32", {"tf32": True})):
            model = load_model(p["model_dir"], **options)
            xla = tf.function(lambda x: model(x)["logits"], jit_compile=True)
            found[name] = {"eager": float(np.max(np.abs(model(tokens)["logits"].numpy() - expected))),
                           "xla": float(np.max(np.abs(xla(tokens).numpy() - expected)))}
            if name == "default":
                greedy = generate(model, prompts, p["greedy"], top_k=1, seed=0)
    first = None
    for a, b in zip(cpu_greedy, greedy):
        n = min(len(a), len(b))
        differ = np.nonzero(a[:n] != b[:n])[0]
        if len(a) != len(b) or len(differ):
            first = int(differ[0]) if len(differ) else n
            break
    found["greedy_same"], found["greedy_first_difference"] = first is None, first
    return found


def stage_decode(p):
    """{"dtype/batch": {"per_token_s": [...], "first_s": s}} of `tfgpt2.generate` on the device."""
    import tensorflow as tf
    from tfgpt2 import generate, load_model
    found = {}
    with gpu_turn(p["lock"]), tf.device(p["device"]):
        for dtype in p["dtypes"]:
            model = load_model(p["model_dir"], dtype=dtype)
            for batch in p["batches"]:
                def run(n, prompts=[[1]] * batch):
                    return lambda: generate(model, prompts, n, seed=0)
                first = timed(run(p["long"])) + timed(run(p["short"]))  # compiles: one bucket, one program
                pairs = [(timed(run(p["long"])), timed(run(p["short"]))) for _ in range(p["runs"])]
                found[f"{dtype}/{batch}"] = {"first_s": first, "per_token_s": per_token_times(pairs, p)}
    return found


def stage_train(p):
    """Seconds of each training step after two warm-up ones, the first step's, peak GPU bytes."""
    import tensorflow as tf
    from tfgpt2 import load_model
    from tfgpt2.train.optimizers import make_optimizer
    from tfgpt2.train.step import Trainer
    with gpu_turn(p["lock"]), tf.device(p["device"]):
        model = load_model(p["model_dir"], dtype=p["precision"])
        trainer = Trainer(model, make_optimizer("adam", 2e-5))
        rng = np.random.default_rng(0)
        data = [tf.constant(rng.integers(0, model.hparams.n_vocab, [p["batch"], p["length"] + 1]), tf.int32)
                for _ in range(p["steps"] + 2)]
        seconds = [timed(lambda b=b: float(trainer.step(b))) for b in data]
        peak = (tf.config.experimental.get_memory_info("GPU:0")["peak"]
                if p["device"].startswith("/GPU") else None)
    return {"step_s": seconds[2:], "first_s": seconds[0], "peak_bytes": peak}


def stage_hf(p):
    """HF transformers on the device: eager decode (and static cache + torch.compile), training,
    and the device-to-device copy rate. Imports PyTorch alone."""
    import torch
    import transformers
    with open(os.path.join(p["model_dir"], "hparams.json")) as f:
        hp = json.load(f)
    device = "cuda" if torch.cuda.is_available() and not p["cpu_only"] else "cpu"
    config = transformers.GPT2Config(vocab_size=hp["n_vocab"], n_positions=hp["n_ctx"], n_embd=hp["n_embd"],
                                     n_layer=hp["n_layer"], n_head=hp["n_head"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def clocked(fn):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    found = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "decode": {}, "train": {}}
    with gpu_turn(p["lock"]):
        if p["compiled"]:  # decode only, batch 1: each batch size is another compile of minutes
            for dtype in p["dtypes"]:
                model = transformers.GPT2LMHeadModel(config).to(device, getattr(torch, dtype)).eval()
                model.generation_config.cache_implementation = "static"
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                found["decode"][f"static+compile/{dtype}/1"] = _hf_decode(model, p, 1, device, clocked)
            return found
        if device == "cuda":
            x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
            y = torch.empty_like(x)
            y.copy_(x)
            seconds = [clocked(lambda: y.copy_(x)) for _ in range(10)]
            found["copy_bytes_per_s"] = 2 * x.numel() / float(np.median(seconds))  # read + written
            del x, y
        for dtype in p["dtypes"]:
            model = transformers.GPT2LMHeadModel(config).to(device, getattr(torch, dtype)).eval()
            for batch in p["batches"]:
                found["decode"][f"eager/{dtype}/{batch}"] = _hf_decode(model, p, batch, device, clocked)
            del model
        for precision in ("float32", "bfloat16"):
            found["train"][precision] = _hf_train(transformers.GPT2LMHeadModel(config).to(device).train(), p,
                                                  hp["n_vocab"], precision, device, clocked)
    return found


def _hf_decode(model, p, batch, device, clocked):
    import torch
    ids = torch.ones([batch, 1], dtype=torch.long, device=device)

    def run(n):
        def generate():
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=True, top_k=0, pad_token_id=0)
        return generate
    first = clocked(run(p["long"])) + clocked(run(p["short"]))
    pairs = [(clocked(run(p["long"])), clocked(run(p["short"]))) for _ in range(p["runs"])]
    return {"first_s": first, "per_token_s": per_token_times(pairs, p)}


def _hf_train(model, p, n_vocab, precision, device, clocked):
    import torch
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-5, fused=device == "cuda")
    tokens = torch.randint(0, n_vocab, [p["train_batch"], p["train_length"]], device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = [clocked(step) for _ in range(p["steps"] + 2)]
    return {"step_s": seconds[2:], "first_s": seconds[0],
            "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


STAGES = {"checks": stage_checks, "decode": stage_decode, "train": stage_train, "hf": stage_hf}


def child(stage, params, *, python, timeout, env=None):
    """Run a stage in a child process; its result, or {"error": why}."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        path = out.name
    command = [python, os.path.join(HERE, "gpu_check.py"), "--stage", stage, "--params", json.dumps(params),
               "--stage_out", path]
    try:
        done = subprocess.run(command, env=child_env(env), timeout=max(timeout, 1),
                              capture_output=True, text=True)
        if done.returncode:
            return {"error": f"exit status {done.returncode}: {done.stderr.strip()[-1500:]}"}
        with open(path) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s"}
    finally:
        os.remove(path)


def child_env(extra):
    """This process's environment with `extra`; XLA_FLAGS added to the ones set here (which may
    tell XLA where CUDA is), not in their place."""
    env = dict(os.environ, **(extra or {}))
    if (extra or {}).get("XLA_FLAGS"):
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {extra['XLA_FLAGS']}".strip()
    return env


class Runner:
    """Starts stages as child processes within the time budget (in this process for a dry run).
    `start` returns a callable that waits for the stage's result."""

    def __init__(self, args, lock):
        self.args, self.lock = args, lock
        self.deadline = time.monotonic() + args.budget

    def params(self, **extra):
        a = self.args
        return dict(model_dir=a.model_dir, device="/CPU:0" if a.cpu_only else "/GPU:0", lock=self.lock,
                    cpu_only=a.cpu_only, greedy=a.greedy, short=a.short, long=a.long, runs=a.runs, **extra)

    def start(self, stage, params, *, env=None, python=None):
        if self.args.cpu_only:  # a dry run: one process, so no XLA_FLAGS of a variant's own
            result = STAGES[stage](params)
            return lambda: result
        import concurrent.futures
        timeout = self.deadline - time.monotonic()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        future = pool.submit(child, stage, params, python=python or sys.executable, timeout=timeout, env=env)
        pool.shutdown(wait=False)
        return future.result


# ---- the report ---------------------------------------------------------------------------------

CHECKS = [report.column("check", "check"), report.column("value", "value", ".3g"),
          report.column("limit", "limit"), report.column("ok", "ok")]
VARIANT = [report.column("variant", "variant"), report.column("xla_flags", "XLA_FLAGS"),
           report.column("ms_per_token", "decode ms/token, batch 1, float32", ".3f"), report.column("error", "error")]
DECODE = [report.column("dtype", "dtype"), report.column("batch", "batch"),
          report.column("ms_per_token", "tfgpt2 ms/token", ".3f"), report.column("tokens_per_s", "tfgpt2 tokens/s", ",.0f"),
          report.column("floor_ms", "floor ms/token", ".3f"), report.column("vs_floor", "x floor", ".1f"),
          report.column("hf_eager_ms", "HF eager ms/token", ".3f"), report.column("hf_compiled_ms", "HF static+compile ms/token", ".3f"),
          report.column("vs_hf", "HF eager / tfgpt2", ".1f"), report.column("first_s", "first calls s", ".1f")]
TRAIN = [report.column("precision", "precision"), report.column("shape", "batch x length"),
         report.column("tokens_per_s", "tfgpt2 tokens/s", ",.0f"), report.column("hf_tokens_per_s", "HF eager tokens/s", ",.0f"),
         report.column("vs_hf", "tfgpt2 / HF", ".2f"), report.column("peak_gb", "tfgpt2 peak GPU GB", ".1f"),
         report.column("hf_peak_gb", "HF peak GPU GB", ".1f"), report.column("first_step_s", "first step s", ".1f")]


def per_token(found):
    """(ms/token spread, first calls s) of a decode measurement, or (None, None)."""
    if not found:
        return None, None
    return report.spread([s * 1e3 for s in found["per_token_s"]]), found["first_s"]


def check_rows(checks, atol, greedy):
    if "error" in checks:
        return [{"check": "checks stage", "value": None, "limit": "", "ok": False, "error": checks["error"]}]
    rows = [{"check": f"max |logits - CPU's|, {way}, TensorFlow's defaults", "value": checks["default"][way],
             "limit": f"<= {atol:g}", "ok": checks["default"][way] <= atol} for way in ("xla", "eager")]
    rows += [{"check": f"max |logits - CPU's|, {way}, tf32=True (opt-in)", "value": checks["tf32"][way],
              "limit": "reported", "ok": None} for way in ("xla", "eager")]
    rows += [{"check": "max |logits| (scale)", "value": checks["scale"], "limit": "", "ok": None},
             {"check": f"greedy tokens ({greedy}, 2 rows) equal the CPU's", "value": None, "limit": "identical",
              "ok": checks["greedy_same"], "first_difference": checks["greedy_first_difference"]}]
    return rows


def decode_rows(found, hf, floor_s, batches):
    rows = []
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        for batch in batches:
            ms, first = per_token(found.get(f"{dtype}/{batch}"))
            eager, _ = per_token(hf.get("decode", {}).get(f"eager/{dtype}/{batch}"))
            compiled, _ = per_token(hf.get("decode", {}).get(f"static+compile/{dtype}/{batch}"))
            floor = floor_s * size / 4 * 1e3 if floor_s else None
            rows.append({"dtype": dtype, "batch": batch, "ms_per_token": ms, "first_s": first,
                         "tokens_per_s": report.spread([batch * 1e3 / v for v in (ms["min"], ms["median"], ms["max"])])
                         if ms else None,
                         "floor_ms": floor, "vs_floor": ms and floor and ms["median"] / floor,
                         "hf_eager_ms": eager, "hf_compiled_ms": compiled,
                         "vs_hf": ms and eager and eager["median"] / ms["median"]})
    return rows


def train_rows(trains, hf, shape):
    rows = []
    for precision, hf_name in (("float32", "float32"), ("mixed_bfloat16", "bfloat16")):
        found, theirs = trains.get(precision, {}), hf.get("train", {}).get(hf_name, {})
        tokens = shape[0] * shape[1]
        ours = report.spread([tokens / s for s in found["step_s"]]) if "step_s" in found else None
        other = report.spread([tokens / s for s in theirs["step_s"]]) if "step_s" in theirs else None
        gb = lambda b: b / 1e9 if b else None  # noqa: E731
        rows.append({"precision": precision, "shape": f"{shape[0]} x {shape[1]}", "tokens_per_s": ours,
                     "hf_tokens_per_s": other, "vs_hf": ours and other and ours["median"] / other["median"],
                     "peak_gb": gb(found.get("peak_bytes")), "hf_peak_gb": gb(theirs.get("peak_bytes")),
                     "first_step_s": found.get("first_s"), "error": found.get("error")})
    return rows


def headlines_of(decode, train, cpu_only):
    if cpu_only:
        return []
    lines = [{"what": f"GPU decode, batch {r['batch']}, {r['dtype']}",
              "figure": f"{r['ms_per_token']['median']:.3f} ms/token ({r['vs_floor']:.1f}x the floor), "
                        f"HF eager {r['hf_eager_ms']['median']:.2f}" if r["hf_eager_ms"] else
                        f"{r['ms_per_token']['median']:.3f} ms/token"}
             for r in decode if r["ms_per_token"] and r["batch"] in (1, 8)]
    lines += [{"what": f"GPU training, 124M, {r['precision']}, {r['shape']}",
               "figure": f"{r['tokens_per_s']['median']:,.0f} tokens/s"
                         + (f", {r['vs_hf']:.2f}x HF eager" if r["vs_hf"] else "")}
              for r in train if r["tokens_per_s"]]
    return lines


# ---- the command --------------------------------------------------------------------------------

def arguments(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", help="a model folder (default: 124M-shaped random weights, std 0.1, made here)")
    p.add_argument("--cpu-only", dest="cpu_only", action="store_true",
                   help="a dry run with the CPU as the device, in this process (the logic, no GPU figures)")
    p.add_argument("--atol", type=float, default=5e-4, help="the logits' tolerance (float32)")
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens compared")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batch sizes")
    p.add_argument("--short", type=int, default=130)
    p.add_argument("--long", type=int, default=190, help="decode lengths; 1 + each in one bucket (192 for the defaults)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="XLA_FLAGS tried for batch-1 float32 decode; the fastest runs the full matrix")
    p.add_argument("--train_batch", type=int, default=16)
    p.add_argument("--train_length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hf_python", default=sys.executable, help="a Python with torch and transformers")
    p.add_argument("--no_hf", action="store_true", help="leave HF transformers out")
    p.add_argument("--hf_compile", action="store_true", help="HF with a static cache and torch.compile too")
    p.add_argument("--budget", type=float, default=480, help="seconds for all the stages; a stage past it is stopped")
    p.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)  # a child's stage
    p.add_argument("--params", help=argparse.SUPPRESS)
    p.add_argument("--stage_out", help=argparse.SUPPRESS)
    report.add_arguments(p, "gpu-check")
    args = p.parse_args(argv)
    if args.cpu_only and args.name == "gpu-check":
        args.name = "cpu-dry-run"
    return args


def run_stages(args, lock):
    """(checks, {variant: decode}, best variant, decode, {precision: train}, hf). The children
    start together and take the GPU in turn; the full decode matrix waits for the variants'
    verdict, HF's compiled decode (minutes of compiling) for everything else."""
    run = Runner(args, lock)
    hf_wanted = not args.no_hf and (not args.cpu_only or _has_torch())
    hf_params = dict(dtypes=["float32", "bfloat16"], batches=args.batch, train_batch=args.train_batch,
                     train_length=args.train_length, steps=args.steps)
    checks = run.start("checks", run.params())
    sweep = {v: run.start("decode", run.params(dtypes=["float32"], batches=[1]), env={"XLA_FLAGS": VARIANTS[v]})
             for v in (["default"] if args.cpu_only else args.variants)}
    trains = {precision: run.start("train", run.params(precision=precision, batch=args.train_batch,
                                                       length=args.train_length, steps=args.steps))
              for precision in ("float32", "mixed_bfloat16")}
    hf = run.start("hf", run.params(compiled=False, **hf_params), python=args.hf_python) if hf_wanted else dict
    sweep = {v: wait() for v, wait in sweep.items()}
    timed_ok = {v: float(np.median(r["float32/1"]["per_token_s"])) for v, r in sweep.items() if "error" not in r}
    best = min(timed_ok, key=timed_ok.get) if timed_ok else "default"
    decode = run.start("decode", run.params(dtypes=["float32", "bfloat16"], batches=args.batch),
                       env={"XLA_FLAGS": VARIANTS[best]})()
    checks, trains, hf = checks(), {k: wait() for k, wait in trains.items()}, hf()
    if hf_wanted and args.hf_compile and not args.cpu_only:
        compiled = run.start("hf", run.params(compiled=True, **hf_params), python=args.hf_python)()
        hf.setdefault("decode", {}).update(compiled.get("decode", {}))
        if "error" in compiled:
            hf["compiled_error"] = compiled["error"]
    return checks, sweep, best, decode, trains, hf


def _has_torch():
    import importlib.util
    return all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def main(argv=None):
    args = arguments(argv)
    if args.stage:  # a child: one stage, its result to --stage_out
        result = STAGES[args.stage](json.loads(args.params))
        with open(args.stage_out, "w") as f:
            json.dump(result, f)
        return 0
    import tensorflow as tf
    if not args.cpu_only and not tf.config.list_physical_devices("GPU"):
        print(no_gpu_message(), file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="tfgpt2-gpu-check-") as tmp:
        if not args.model_dir:
            from tfgpt2.hparams import published_hparams
            from tfgpt2.testing.checkpoints import make_checkpoint
            print("writing 124M-shaped random weights ...", file=sys.stderr, flush=True)
            args.model_dir = make_checkpoint(os.path.join(tmp, "124M"), published_hparams("124M"), std=0.1)
            made = True
        else:
            made = False
        results = run_stages(args, None if args.cpu_only else os.path.join(tmp, "gpu.lock"))
        return publish(args, argv, made, *results)  # while the weights it measured are there


def weight_bytes_of(model_dir):
    """The float32 bytes of a model folder's weights (the tied `wte` once)."""
    import math
    from tfgpt2.formats.variables import variable_shapes
    from tfgpt2.hparams import load_hparams
    return 4 * sum(math.prod(shape) for shape in variable_shapes(load_hparams(model_dir)).values())


def publish(args, argv, made, checks, sweep, best, decode, trains, hf):
    """The report of the stages' results; the exit status."""
    copy_rate = hf.get("copy_bytes_per_s")
    weight_bytes = weight_bytes_of(args.model_dir)
    floor_s = weight_bytes / copy_rate if copy_rate else None
    checks_rows = check_rows(checks, args.atol, args.greedy)
    variant_rows = [{"variant": v, "xla_flags": VARIANTS[v] or "(none)",
                     "ms_per_token": per_token(r.get("float32/1"))[0], "error": r.get("error")}
                    for v, r in sweep.items()]
    decoding = decode_rows(decode if "error" not in decode else {}, hf, floor_s, args.batch)
    training = train_rows(trains, hf, (args.train_batch, args.train_length))
    ok = all(c["ok"] is not False for c in checks_rows)
    notes = [f"Device: {hf.get('device') or ('the CPU (dry run)' if args.cpu_only else 'GPU')}, against the CPU. "
             f"Weights: {'random, 124M-shaped (std 0.1)' if made else args.model_dir}. TensorFlow's settings left "
             f"at their defaults. Decode: `tfgpt2.generate` (XLA, temperature 1), {args.long} and {args.short} new "
             f"tokens after a 1-token prompt, per pair of runs, median and range of {args.runs}, under the fastest "
             f"XLA_FLAGS variant ({best}); first calls: both lengths' first calls, compilation included. The "
             f"floor: the weights' {weight_bytes / 1e6:,.0f} MB (float32; half in bfloat16) over the measured "
             f"device-to-device copy rate ({copy_rate / 1e12:.2f} TB/s, bytes read + written)." if copy_rate else
             f"Device: {'the CPU (dry run)' if args.cpu_only else 'GPU'}.",
             f"Training: Adam steps (`Trainer`, XLA), {args.steps} after two warm-up ones; HF: GPT2LMHeadModel, "
             f"fused Adam, eager, float32 and bfloat16 autocast, same shape. Checks: "
             f"{'all passed' if ok else 'FAILED'}."]
    if "error" in decode:
        notes.append(f"Decode matrix failed: {decode['error']}")
    for key, what in (("error", "HF transformers"), ("compiled_error", "HF with a static cache and torch.compile")):
        if key in hf:
            notes.append(f"{what} failed: {hf[key]}")
    if args.cpu_only:
        notes.insert(0, "Dry run on the CPU (--cpu-only): the script's logic, no GPU figures.")
    settings = {k: getattr(args, k) for k in ("model_dir", "cpu_only", "atol", "greedy", "batch", "short", "long",
                                              "runs", "variants", "train_batch", "train_length", "steps",
                                              "hf_compile", "budget")}
    settings.update(checks_passed=ok, best_variant=best, xla_flags=VARIANTS[best], copy_bytes_per_s=copy_rate,
                    weight_bytes=weight_bytes)
    title = "GPU check" if not args.cpu_only else "GPU check (dry run on the CPU)"
    report.publish(args, title, [report.table(CHECKS, checks_rows, "Numbers against the CPU"),
                                 report.table(VARIANT, variant_rows, "Decode under XLA_FLAGS variants"),
                                 report.table(DECODE, decoding, "Decoding"),
                                 report.table(TRAIN, training, "Training step")],
                   tool=__file__, argv=argv, settings=settings, notes=notes,
                   headlines=headlines_of(decoding, training, args.cpu_only))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
