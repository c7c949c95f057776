#!/usr/bin/env python3
"""Generation speed of tfgpt2 against OpenAI's reference and other ports, in the same run.

    tfgpt2 make-checkpoint 124M          # a model folder (random weights run at the same speed)
    python tools/benchmark.py --model_dir models/124M --batch 1 8

Each candidate runs in a fresh process of its own, one after another (`--rounds N`: N times,
the candidates taking turns, each one's runs pooled, so that a noisy machine's slow spells
fall on all of them), on the same checkpoint shape: tfgpt2 with XLA, tfgpt2 with XLA and every generation control on
(tfgpt2-xla-controls), tfgpt2 without XLA, the reference `sample_sequence`
(`--reference_src`, batch 1 only: the original fails above), KerasHub's GPT2CausalLM and
transformers' GPT2LMHeadModel (random weights of the same shape) where those packages are
installed, and llama.cpp (batch 1) on the GGUF file of the same weights where it is at hand
(`--llama_cpp DIR`, its llama-bench, or llama-cpp-python: tools/llama_peer.py). Per candidate
and batch size:

- decode: time per generated token (per step for the batch), from the difference between
  generating `--long` and `--short` new tokens after a 1-token prompt, so that prefill and
  compilation are left out; per run (the i-th run of each length paired), after a warm-up:
  the median and range over `--runs`;
- prefill: tokens per second for a `--prompt_len`-token prompt (one new token);
- llama.cpp by its llama-bench: decode, its tokens/s generating `--long` - `--short` tokens
  after `--short` in the cache, and prefill, its tokens/s reading the prompt, each per
  repetition after its warm-up (compile and resident set before: n/a); by llama-cpp-python, as
  the others (each token its logits' argmax);
- each row's decode and prefill tokens/s as a ratio of llama.cpp's at its batch size;
- compile: the first call's time minus a warm call's, both lengths;
- peak memory: the process's peak resident set (VmHWM), the runtime included, after the
  `--long` runs alone (one length: one compiled program), after both decode lengths (the
  prefill's long prompt left out) and at the end; and its resident set before the first
  call (VmRSS: the runtime and the weights; n/a for the reference, which starts its
  process then and restores the checkpoint in each call).

`--dtype bfloat16` (or int8: `model.quantize("int8")`) runs tfgpt2 with that Keras dtype policy;
the others stay float32 but llama.cpp, whose weights match it (`llama_peer.GGUF_TYPES`: 16 bits
as f16, int8 as q8_0; `--gguf_type`). Then, in a process of its own, that dtype's quality against
float32 (`quality`: greedy agreement and loss ratio, as tools/benchmark_litert.py).
Sampling is the original scripts' default (temperature 1, top_k 0, top_p 1) unless
`--top_k` says otherwise. The
report (tools/report.py) goes to `--report DIR` as `--name`.json and .md (default
generation).
"""
import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from . import llama_peer, report
except ImportError:  # run as `python tools/benchmark.py`: this folder is on sys.path
    import llama_peer
    import report

ROOT = report.ROOT
DEFAULT_REFERENCE = os.path.join(os.environ.get("TFGPT2_SHARED", os.path.join(os.path.dirname(ROOT), "shared")),
                                 "openai-gpt-2", "src")
OURS = ("tfgpt2-xla", "tfgpt2-xla-controls", "tfgpt2")
CANDIDATES = ["tfgpt2-xla", "tfgpt2-xla-controls", "tfgpt2", "reference", "keras-hub", "transformers", "llama.cpp"]
ONE_ROW = {"reference": "the original sample_sequence fails at batch > 1", "llama.cpp": "batch 1 only here"}


def rss_mb(pid="self", key="VmHWM"):
    """The process's peak (VmHWM) or current (VmRSS) resident set in MB."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) / 1024


# ---- one candidate in its own process ----------------------------------------------------

# every generation control on, with values that never end a row early (<|endoftext|> banned)
CONTROLS = dict(logit_bias={50256: -100, 11: 0.5}, repetition_penalty=1.2, presence_penalty=0.3,
                frequency_penalty=0.2, min_p=0.05, stop=[[50256, 50256], [50256]])


def tfgpt2_runner(args, jit_compile, controls=None):
    from tfgpt2 import load_model
    from tfgpt2.sample import generate
    model = load_model(args.model_dir, dtype=args.dtype)
    controls = controls or {}

    def run(context, length):
        generate(model, context.tolist(), length, top_k=args.top_k, seed=0, jit_compile=jit_compile, **controls)
    return repeated(run), rss_mb


def reference_runner(args):
    # the module by its path (the standard library and NumPy): `import tfgpt2` would bring
    # TensorFlow 2 and Keras into this process only to start the reference's own
    import importlib.util
    spec = importlib.util.spec_from_file_location("reference", os.path.join(ROOT, "tfgpt2", "testing", "reference.py"))
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    ref = reference.Reference(args.reference_src, args.model_dir)

    def run(context, length, repeats):
        # each call builds a graph and restores the checkpoint; only its sess.run calls are timed
        return ref.sample_sequence(context=context, length=length, top_k=args.top_k, seed=0, repeats=repeats)[1]
    return run, functools.partial(rss_mb, ref.pid)


def hparams_of(model_dir):
    with open(os.path.join(model_dir, "hparams.json")) as f:
        return json.load(f)


def keras_hub_runner(args):
    import keras
    import keras_hub
    hp = hparams_of(args.model_dir)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=hp["n_vocab"], num_layers=hp["n_layer"], num_heads=hp["n_head"],
        hidden_dim=hp["n_embd"], intermediate_dim=4 * hp["n_embd"], max_sequence_length=hp["n_ctx"])
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    sampler = keras_hub.samplers.TopKSampler(k=args.top_k) if args.top_k else keras_hub.samplers.RandomSampler()
    lm.compile(sampler=sampler)  # generation is XLA-compiled by default on this backend

    def run(context, length):
        batch, n = context.shape
        total = n + length
        ids = np.zeros([batch, total], np.int32)
        ids[:, :n] = context
        mask = np.zeros([batch, total], bool)
        mask[:, :n] = True
        lm.generate({"token_ids": ids, "padding_mask": mask}, max_length=total, stop_token_ids=None)
    keras.utils.set_random_seed(0)
    return repeated(run), rss_mb


def transformers_runner(args):
    import torch
    import transformers
    hp = hparams_of(args.model_dir)
    config = transformers.GPT2Config(vocab_size=hp["n_vocab"], n_positions=hp["n_ctx"], n_embd=hp["n_embd"],
                                     n_layer=hp["n_layer"], n_head=hp["n_head"])
    model = transformers.GPT2LMHeadModel(config).eval()

    def run(context, length):
        with torch.no_grad():
            model.generate(torch.tensor(context), do_sample=True, top_k=args.top_k, max_new_tokens=length,
                           min_new_tokens=length, attention_mask=torch.ones(context.shape, dtype=torch.long),
                           pad_token_id=0)
    torch.manual_seed(0)
    return repeated(run), rss_mb


def llama_cpp_runner(args):
    """llama-cpp-python on the GGUF file (`llama_peer.python_runner`)."""
    n_ctx = max(args.long, args.prompt_len) + 8
    return repeated(llama_peer.python_runner(args, args.gguf, n_ctx)), rss_mb


def llama_bench_figures(args):
    """The worker's figures from llama.cpp's own llama-bench (`llama_peer.bench`)."""
    decode = llama_peer.bench(args, args.gguf, prompt=0, new=args.long - args.short, depth=args.short)
    prefill = llama_peer.bench(args, args.gguf, prompt=args.prompt_len, new=0)
    peak = llama_peer.peak_rss_mb()
    return dict(step_ms=[1e3 / t for t in decode], tokens_per_s=decode, prefill_tokens_per_s=prefill,
                compile_s=None, peak_rss_mb=peak, decode_peak_rss_mb=None, long_peak_rss_mb=None,
                loaded_rss_mb=None)


def quality(args):
    """--dtype against float32 on --model_dir's weights, as tools/benchmark_litert.py measures
    int8: the greedy agreement (the --dtype model's eager argmax along float32's greedy sequence,
    --quality_steps steps, within n_ctx, after each of --quality_prompts random prompts) and the mean losses over
    --text_tokens tokens of --text (`tfgpt2.train.perplexity`, as `tfgpt2 evaluate`)."""
    from tfgpt2 import load_model
    from tfgpt2.encoder import default_encoder
    from tfgpt2.sample import generate
    from tfgpt2.train.perplexity import evaluate
    full, low = load_model(args.model_dir), load_model(args.model_dir, dtype=args.dtype)
    rng = np.random.default_rng(1)
    agree = []
    for length in rng.integers(1, 24, args.quality_prompts):
        prompt = rng.integers(0, full.hparams.n_vocab, length).tolist()
        steps = min(args.quality_steps, full.hparams.n_ctx - length)  # within the window
        tokens = list(generate(full, [prompt], steps, temperature=0)[0][length:])
        logits = low([prompt + tokens[:-1]])["logits"].numpy()[0, length - 1:]
        agree.extend(logits.argmax(-1) == tokens)
    enc = default_encoder()
    with open(args.text, encoding="utf-8") as f:
        tokens = [enc.eot_token] + enc.encode(f.read())[:args.text_tokens - 1]
    loss_f, loss_q = (evaluate(m, tokens)["loss"] for m in (full, low))
    return dict(dtype=args.dtype, agreement=float(np.mean(agree)), loss_f=loss_f, loss_q=loss_q,
                ratio=loss_q / loss_f, tokens=len(tokens))


def repeated(run):
    """run(context, length) -> run(context, length, repeats) giving the seconds of each call."""
    def timed(context, length, repeats):
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(context, length)
            seconds.append(time.perf_counter() - start)
        return seconds
    return timed


def worker(args):
    if args.worker == "quality":
        print(json.dumps(quality(args)))
        return
    if args.worker == "llama.cpp" and llama_peer.peer(args) == "programs":
        print(json.dumps(llama_bench_figures(args)))
        return
    runners = {"tfgpt2-xla": lambda: tfgpt2_runner(args, True), "tfgpt2": lambda: tfgpt2_runner(args, False),
               "tfgpt2-xla-controls": lambda: tfgpt2_runner(args, True, CONTROLS),
               "reference": lambda: reference_runner(args), "keras-hub": lambda: keras_hub_runner(args),
               "transformers": lambda: transformers_runner(args), "llama.cpp": lambda: llama_cpp_runner(args)}
    run, rss = runners[args.worker]()
    loaded = rss(key="VmRSS") if args.worker not in ("reference", "llama.cpp") else None
    one = np.ones([args.batch_size, 1], np.int32)
    prompt = np.random.default_rng(0).integers(0, 50000, size=[args.batch_size, args.prompt_len]).astype(np.int32)
    # the first call of each shape compiles (or, for the reference, runs a fresh graph)
    long = run(one, args.long, args.runs + 1)
    long_peak = rss()
    short = run(one, args.short, args.runs + 1)
    decode_peak = rss()
    prefill = run(prompt, 1, args.runs + 1)
    steps = [(lg - sh) / (args.long - args.short) for lg, sh in zip(long[1:], short[1:])]
    compile_s = short[0] - np.median(short[1:]) + long[0] - np.median(long[1:])
    print(json.dumps(dict(step_ms=[s * 1e3 for s in steps], tokens_per_s=[args.batch_size / s for s in steps],
                          prefill_tokens_per_s=[args.batch_size * args.prompt_len / s for s in prefill[1:]],
                          compile_s=float(compile_s), peak_rss_mb=rss(), decode_peak_rss_mb=decode_peak,
                          long_peak_rss_mb=long_peak, loaded_rss_mb=loaded,
                          seconds={"short": short, "long": long, "prefill": prefill})))


# ---- the driver ---------------------------------------------------------------------------

def available(candidate, args):
    if candidate == "reference":
        return os.path.isfile(os.path.join(args.reference_src, "model.py"))
    if candidate == "llama.cpp":
        return llama_peer.peer(args) is not None
    module = {"keras-hub": "keras_hub", "transformers": "transformers"}.get(candidate)
    if module is None:
        return True
    import importlib.util
    return importlib.util.find_spec(module) is not None


def measure(candidate, batch, args):
    command = [sys.executable, os.path.abspath(__file__), "--worker", candidate, "--batch_size", str(batch),
               "--model_dir", args.model_dir, "--reference_src", args.reference_src, "--runs", str(args.runs),
               "--short", str(args.short), "--long", str(args.long), "--prompt_len", str(args.prompt_len),
               "--top_k", str(args.top_k), "--dtype", args.dtype, "--threads", str(args.threads)]
    command += [f"--{k}={getattr(args, k)}" for k in ("quality_prompts", "quality_steps", "text", "text_tokens")]
    command += ["--gguf", args.gguf] if args.gguf else []
    command += ["--llama_cpp", args.llama_cpp] if args.llama_cpp else []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1][:120]}
    return json.loads(done.stdout.strip().splitlines()[-1])


COLUMNS = [report.column("implementation", "implementation"), report.column("batch", "batch"),
           report.column("step_ms", "decode ms/token", ".1f"), report.column("tokens_per_s", "tokens/s", ".1f"),
           report.column("vs_reference", "time vs reference", ".2f"),
           report.column("vs_llama_cpp", "tokens/s vs llama.cpp", ".2f"),
           report.column("prefill_tokens_per_s", "prefill tokens/s", ".0f"),
           report.column("prefill_vs_llama_cpp", "prefill vs llama.cpp", ".2f"),
           report.column("compile_s", "compile s", ".1f"), report.column("peak_rss_mb", "peak RSS MB", ".0f"),
           report.column("loaded_rss_mb", "RSS before MB", ".0f")]
ERROR = report.column("error", "error")
QUALITY = [report.column("dtype", "dtype"), report.column("agreement", "greedy agreement", ".3f"),
           report.column("loss_f", "float32 loss", ".4f"), report.column("loss_q", "its loss", ".4f"),
           report.column("ratio", "loss ratio", ".4f")]


def rows_of(results):
    """The report's rows from {(candidate, batch): worker figures or {"error"}}."""
    rows = []
    for (candidate, batch), r in results.items():
        row = {"implementation": candidate, "batch": batch}
        if "error" in r:
            rows.append(dict(row, error=r["error"]))
            continue
        row.update({k: report.spread(r[k]) for k in ("step_ms", "tokens_per_s", "prefill_tokens_per_s")})
        row.update({k: r[k] for k in ("compile_s", "peak_rss_mb", "decode_peak_rss_mb", "long_peak_rss_mb",
                                      "loaded_rss_mb")})
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["implementation"] == "reference" and r["batch"] == row["batch"]
                     and "step_ms" in r), None)
        if base and "step_ms" in row:
            row["vs_reference"] = row["step_ms"]["median"] / base["step_ms"]["median"]
        peer = next((r for r in rows if r["implementation"] == "llama.cpp" and r["batch"] == row["batch"]
                     and "step_ms" in r), None)
        if peer and "step_ms" in row:
            row["vs_llama_cpp"] = row["tokens_per_s"]["median"] / peer["tokens_per_s"]["median"]
            row["prefill_vs_llama_cpp"] = row["prefill_tokens_per_s"]["median"] / peer["prefill_tokens_per_s"]["median"]
    return rows


def headlines(rows, dtype="float32", gguf="f32"):
    """tfgpt2-xla's and the reference's decode time per batch size, with tfgpt2-xla's as a ratio
    of the reference's, and with every control on as a ratio of tfgpt2-xla's; tfgpt2-xla's and
    llama.cpp's decode and prefill tokens/s, with tfgpt2-xla's as ratios of llama.cpp's (there
    only, where llama.cpp ran and the reference did not)."""
    found = []
    for row in rows:
        if row["implementation"] not in ("tfgpt2-xla", "tfgpt2-xla-controls", "reference") or "step_ms" not in row:
            continue
        if row["implementation"] == "tfgpt2-xla" and "vs_llama_cpp" in row and "vs_reference" not in row:
            continue
        figure = f"{row['step_ms']['median']:.1f} ms/token"
        if row["implementation"] == "tfgpt2-xla" and row.get("vs_reference"):
            figure += f", {row['vs_reference']:.2f}x the reference's time"
        base = next((r for r in rows if r["implementation"] == "tfgpt2-xla" and r["batch"] == row["batch"]
                     and "step_ms" in r), None)
        if row["implementation"] == "tfgpt2-xla-controls" and base:
            figure += f", {row['step_ms']['median'] / base['step_ms']['median']:.2f}x tfgpt2-xla's time"
        what = {"tfgpt2-xla-controls": "tfgpt2-xla, every generation control on"}.get(row["implementation"],
                                                                                       row["implementation"])
        found.append({"what": f"generation, batch {row['batch']}, {what}", "figure": figure})
    return found + peer_headlines(rows, dtype, gguf)


def peer_headlines(rows, dtype, gguf):
    """tfgpt2-xla's decode and prefill tokens/s in `dtype` beside llama.cpp's on `gguf` weights,
    where both ran."""
    found = []
    for row in rows:
        peer = next((r for r in rows if r["implementation"] == "llama.cpp" and r["batch"] == row["batch"]), None)
        if row["implementation"] != "tfgpt2-xla" or "vs_llama_cpp" not in row or not peer:
            continue
        found.append({"what": f"decode and prefill, batch {row['batch']}, tfgpt2-xla {dtype} against llama.cpp "
                              f"{gguf.upper()}",
                      "figure": f"{row['tokens_per_s']['median']:.1f} against {peer['tokens_per_s']['median']:.1f} "
                                f"tokens/s ({row['vs_llama_cpp']:.2f}x); prefill "
                                f"{row['prefill_tokens_per_s']['median']:.0f} against "
                                f"{peer['prefill_tokens_per_s']['median']:.0f} ({row['prefill_vs_llama_cpp']:.2f}x)"})
    return found


def arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", default="models/124M", help="a model folder (tfgpt2 make-checkpoint 124M)")
    parser.add_argument("--reference_src", default=DEFAULT_REFERENCE, help="the original gpt-2 repository's src/")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--candidates", nargs="+", default=CANDIDATES, choices=CANDIDATES)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each candidate in this many processes, the candidates' taking turns "
                             "(a noisy machine's slow spells fall on all of them); figures over all (default 1)")
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--long", type=int, default=160)
    parser.add_argument("--prompt_len", type=int, default=512)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--dtype", default="float32",
                        help="tfgpt2's Keras dtype policy (bfloat16, ...); the others run in float32")
    parser.add_argument("--quality_prompts", type=int, default=4,
                        help="--dtype against float32: random prompts for the greedy agreement (default 4)")
    parser.add_argument("--quality_steps", type=int, default=64, help="greedy steps after each (default 64)")
    parser.add_argument("--text", default=argparse.__file__, help="the real text for the losses")
    parser.add_argument("--text_tokens", type=int, default=1024, help="tokens of --text for the losses")
    llama_peer.add_arguments(parser)
    report.add_arguments(parser, "generation")
    parser.add_argument("--worker", choices=CANDIDATES + ["quality"], help=argparse.SUPPRESS)
    parser.add_argument("--batch_size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)  # the peer's weights, written by the driver
    return parser.parse_args(argv)


def measure_all(args):
    """{(candidate, batch): figures or {"error"}} and the candidates not at hand: each candidate
    measured in `--rounds` processes, the candidates' alternating, their figures pooled (`pooled`)."""
    results, skipped = {}, []
    for round_ in range(args.rounds):
        for batch in args.batch:
            for candidate in args.candidates:
                if not available(candidate, args):
                    if candidate not in skipped:
                        skipped.append(candidate)
                    print(f"skipping {candidate}: not installed / not found", file=sys.stderr)
                elif candidate in ONE_ROW and batch > 1:
                    results[(candidate, batch)] = {"error": ONE_ROW[candidate]}
                else:
                    print(f"measuring {candidate} at batch {batch} (round {round_ + 1} of {args.rounds}) ...",
                          file=sys.stderr, flush=True)
                    figures = measure(candidate, batch, args)
                    key = (candidate, batch)
                    results[key] = pooled(results[key], figures) if key in results else figures
    return results, skipped


RUNS = ("step_ms", "tokens_per_s", "prefill_tokens_per_s")  # a worker's figures per run


def pooled(a, b):
    """Two rounds' figures of one candidate as one: their runs together, the larger peak
    resident sets, the first round's compile time and resident set before (a failed round's
    error, where one failed)."""
    if "error" in a or "error" in b:
        return a if "error" in a else b
    both = dict(a, **{k: a[k] + b[k] for k in RUNS})
    both.update({k: max(a[k], b[k]) for k in ("peak_rss_mb", "decode_peak_rss_mb", "long_peak_rss_mb")
                 if a[k] is not None})
    if "seconds" in a:
        both["seconds"] = {k: a["seconds"][k] + b["seconds"][k] for k in a["seconds"]}
    return both


def notes_of(args, results, skipped, against=()):
    notes = [f"Decode time per generated token (the whole batch's step): generating {args.long} and "
             f"{args.short} new tokens after a 1-token prompt, the difference per token, median and range "
             f"over {args.runs} paired runs after a warm-up"
             + (f" in each of {args.rounds} rounds (each candidate's process once a round, the candidates' "
                f"alternating, so that a slow spell of the machine falls on all of them; medians over all "
                f"rounds' runs)" if args.rounds > 1 else "") + f"; prefill: a {args.prompt_len}-token prompt; compile: "
             f"the first calls' extra time; peak RSS: the process's peak resident set (VmHWM); RSS before: "
             f"after loading, before the first call. Sampling top_k={args.top_k}; tfgpt2 in {args.dtype}"
             + (", the others in float32" if set(c for c, _ in results) - set(OURS) - {"llama.cpp"} else "")
             + ". Each implementation ran in a process of its own."
             + (f" tfgpt2-xla-controls: tfgpt2-xla with every generation control on, none ending a row early: "
                f"{CONTROLS}." if "tfgpt2-xla-controls" in args.candidates else "")]
    if any(c == "llama.cpp" for c, _ in results):
        notes.append(f"llama.cpp: {llama_peer.describe(args)}, on the GGUF file of --model_dir's weights "
                     f"(tfgpt2 convert --to gguf)"
                     + (f"; decode and prefill by its llama-bench ({args.long - args.short} tokens after "
                        f"{args.short} in the cache; a {args.prompt_len}-token prompt), {args.runs} repetitions "
                        f"after its warm-up" if llama_peer.peer(args) == "programs" else
                        "; by llama-cpp-python, each new token its logits' argmax") + ".")
    if skipped:
        notes.append(f"Not installed or not found here: {', '.join(skipped)}.")
    for q in against:
        notes.append(f"{args.dtype} against float32, on the same weights (random weights: how closely it follows "
                     f"float32, not how well either models text): its eager argmax along float32's greedy sequence, "
                     f"{args.quality_steps} steps after each of {args.quality_prompts} random prompts; mean loss "
                     f"over the first {q.get('tokens', args.text_tokens)} tokens of {os.path.basename(args.text)}, "
                     f"{args.dtype} / float32.")
    return notes


def main(argv=None):
    args = arguments(argv)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="tfgpt2-bench-") as folder:
        if "llama.cpp" in args.candidates and available("llama.cpp", args):
            args.gguf = llama_peer.write_gguf(args.model_dir, llama_peer.gguf_type(args), folder)
        results, skipped = measure_all(args)
    against = [measure("quality", 1, args)] if args.dtype != "float32" and "tfgpt2-xla" in args.candidates else []
    rows = rows_of(results)
    settings = {k: getattr(args, k) for k in ("model_dir", "batch", "candidates", "runs", "rounds", "short", "long",
                                              "prompt_len", "top_k", "dtype", "llama_cpp", "threads")}
    settings.update({k: getattr(args, k) for k in ("quality_prompts", "quality_steps", "text", "text_tokens")
                     if against})
    columns = [c for c in COLUMNS if c["key"] not in ("vs_reference", "vs_llama_cpp", "prefill_vs_llama_cpp")
               or any(c["key"] in r for r in rows)]
    columns += [ERROR] * any("error" in r for r in rows)
    tables = [report.table(columns, rows)] + [report.table(QUALITY + [ERROR] * ("error" in q), [q],
                                                           f"{args.dtype} against float32") for q in against]
    report.publish(args, "Generation speed", tables, tool=__file__, argv=argv, settings=settings,
                   notes=notes_of(args, results, skipped, against),
                   headlines=with_quality(headlines(rows, args.dtype, llama_peer.gguf_type(args)), against))
    return 0 if all("error" not in r or k[0] in ONE_ROW and k[1] > 1 for k, r in results.items()) \
        and all("error" not in q for q in against) else 1


def with_quality(found, against):
    """The headlines with --dtype's quality against float32: on llama.cpp's headline where it
    ran, else as a headline of its own."""
    for q in against:
        if "error" in q:
            continue
        text = f"greedy agreement with float32 {q['agreement']:.3f}, loss ratio {q['ratio']:.4f}"
        peer = [h for h in found if h["what"].startswith("decode and prefill")]
        if peer:
            peer[-1]["figure"] += "; " + text
        else:
            found.append({"what": f"{q['dtype']} against float32", "figure": text})
    return found


if __name__ == "__main__":
    sys.exit(main())
