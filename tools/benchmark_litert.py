#!/usr/bin/env python3
"""float32 SavedModel, LiteRT float32 and int8 files, and the Keras int8 model, side by side.

    python tools/benchmark_litert.py                     # a 124M-shaped random model, made here
    python tools/benchmark_litert.py --model_dir models/124M --text /usr/lib/python3.11/argparse.py

Per form: file size, peak resident memory of a fresh process once the form is loaded, and
decode time per token at batch 1 (each form in its own process; SavedModel and Keras: the
`generate` loop under XLA, from the difference between `--long` and `--short` new tokens, per
pair of runs; LiteRT: each `decode` call of the file, on the runtime's default threads). Then
int8's quality against float32: the greedy agreement (int8's argmax along float32's greedy
sequence, `--steps` steps after each of `--prompts` random prompts), and the ratio of mean losses
over `--tokens` tokens of a real text (`--text`, default Python's own argparse.py): the Keras
models through `tfgpt2.train.perplexity` (as `tfgpt2 evaluate`), the LiteRT files token by token.
The report (tools/report.py) goes to `--report DIR` as `--name`.json and .md (default litert).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from . import report
except ImportError:  # run as `python tools/benchmark_litert.py`: this folder is on sys.path
    import report

FORMS = ("SavedModel float32", "LiteRT float32", "LiteRT int8", "Keras int8 (XLA)")


def peak_mb():
    """This process's peak resident memory (VmHWM: ru_maxrss keeps the parent's across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def child(form, path, *, prompt_len, short, long, runs):
    """In a fresh process: {"load peak MB", "ms per token": [...]} for one form (LiteRT read with
    ai_edge_litert alone, as a client would, without TensorFlow)."""
    prompt = np.random.default_rng(0).integers(0, 50257, [1, prompt_len], dtype=np.int32)
    if form.startswith("LiteRT"):
        from ai_edge_litert.interpreter import Interpreter
        interpreter = Interpreter(model_path=path, num_threads=os.cpu_count())
        prefill, decode = interpreter.get_signature_runner("prefill"), interpreter.get_signature_runner("decode")
        loaded = peak_mb()
        out = prefill(input_ids=prompt)
        times = []
        for i in range(long):
            cache = {name: value for name, value in out.items() if name.startswith("cache")}
            start = time.perf_counter()
            out = decode(input_ids=np.array([[np.argmax(out["logits"][0])]], np.int32),
                         position=np.array(prompt_len + i, np.int32), **cache)
            times.append(time.perf_counter() - start)
        return {"load peak MB": loaded, "ms per token": [t * 1e3 for t in times[1:]]}
    import tensorflow as tf
    if form.startswith("SavedModel"):
        signature = tf.saved_model.load(path).signatures["generate"]
        loaded = peak_mb()

        def run(n):
            signature(input_ids=tf.constant(prompt), attention_mask=tf.ones_like(prompt), max_new_tokens=tf.constant(n),
                      temperature=tf.constant(0.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                      seed=tf.constant(0, tf.int64))["output_ids"].numpy()
    else:
        import keras
        import tfgpt2
        model = keras.models.load_model(path)
        loaded = peak_mb()

        def run(n):
            tfgpt2.generate(model, prompt.tolist(), n, temperature=0)
    run(long), run(short)  # compiles
    pairs = []
    for _ in range(runs):
        start = time.perf_counter()
        run(long)
        middle = time.perf_counter()
        run(short)
        pairs.append(((middle - start) - (time.perf_counter() - middle)) / (long - short) * 1e3)
    return {"load peak MB": loaded, "ms per token": pairs}


def agreement(model_q, float_file, int8_file, *, prompts, steps):
    """(LiteRT int8, Keras int8) argmax agreement along float32's greedy sequences."""
    rng = np.random.default_rng(1)
    lite, keras_ = [], []
    for length in rng.integers(1, 24, prompts):
        prompt = rng.integers(0, 50257, length).tolist()
        (lf, cf), (lq, cq) = float_file.prefill(prompt), int8_file.prefill(prompt)
        tokens = []
        for i in range(steps):
            tokens.append(int(np.argmax(lf)))
            lite.append(int(np.argmax(lq)) == tokens[-1])
            if i + 1 < steps:
                lf, cf = float_file.decode(tokens[-1], len(prompt) + i, cf)
                lq, cq = int8_file.decode(tokens[-1], len(prompt) + i, cq)
        q = model_q([prompt + tokens[:-1]])["logits"].numpy()[0, len(prompt) - 1:].argmax(-1)
        keras_.extend(q == np.array(tokens))
    return float(np.mean(lite)), float(np.mean(keras_))


def litert_loss(file, tokens):
    """Mean next-token loss of a LiteRT file over `tokens`, one decode call a token."""
    logits, cache = file.prefill(tokens[:1])
    losses = []
    for i, token in enumerate(tokens[1:]):
        shifted = logits.astype(np.float64) - logits.max()
        losses.append(np.log(np.exp(shifted).sum()) - shifted[token])
        if i + 2 < len(tokens):
            logits, cache = file.decode(token, i + 1, cache)
    return float(np.mean(losses))


def arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="a model folder (default: a 124M-shaped one, std 0.1, made here)")
    parser.add_argument("--text", default=argparse.__file__, help="the real text for the losses")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of --text for the losses (<= n_ctx)")
    parser.add_argument("--prompt_len", type=int, default=8)
    parser.add_argument("--short", type=int, default=49)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("FORM", "PATH"), help=argparse.SUPPRESS)
    report.add_arguments(parser, "litert")
    return parser.parse_args(argv)


def export_forms(model, model_dir, tmp):
    """Each form of FORMS written under `tmp`: ({form: path}, {form: seconds to write it}, the
    Keras int8 model)."""
    from tfgpt2.formats.checkpoint import load_model
    from tfgpt2.formats.litert import export_litert
    from tfgpt2.formats.saved_model import export_saved_model
    paths, export_s = {}, {}
    for form, make in [
        ("SavedModel float32", lambda p: export_saved_model(model, p)),
        ("LiteRT float32", lambda p: export_litert(model, p + ".tflite")),
        ("LiteRT int8", lambda p: export_litert(model, p + ".tflite", quantize="int8")),
    ]:
        start = time.perf_counter()
        paths[form] = make(os.path.join(tmp, form.replace(" ", "_")))
        export_s[form] = time.perf_counter() - start
    quantized = load_model(model_dir)
    start = time.perf_counter()
    quantized.quantize("int8")
    paths[FORMS[3]] = os.path.join(tmp, "int8.keras")
    quantized.save(paths[FORMS[3]])
    export_s[FORMS[3]] = time.perf_counter() - start
    return paths, export_s, quantized


def speed_rows(paths, export_s, timing):
    """A row per form: export time, size, and a fresh process's load peak and decode speed (`child`)."""
    from tfgpt2.formats.saved_model import folder_bytes
    rows = []
    for form in FORMS:
        out = subprocess.run([sys.executable, __file__, "--child", form, paths[form]]
                             + [f"--{k}={v}" for k, v in timing.items()],
                             capture_output=True, text=True, check=True)
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        size = folder_bytes(paths[form]) if os.path.isdir(paths[form]) else os.path.getsize(paths[form])
        rows.append({"form": form, "export_s": export_s[form], "size_mb": size / 1e6,
                     "load_peak_mb": measured["load peak MB"], "ms_per_token": report.spread(measured["ms per token"])})
    return rows


def quality_rows(args, model, quantized, paths):
    """The int8 forms against float32 (greedy agreement, losses over --text), and the number of
    tokens the losses are over."""
    from tfgpt2.encoder import default_encoder
    from tfgpt2.formats.litert import LiteRTModel
    from tfgpt2.train.perplexity import evaluate
    float_file, int8_file = (LiteRTModel(paths[f"LiteRT {kind}"], num_threads=os.cpu_count())
                             for kind in ("float32", "int8"))
    lite_agree, keras_agree = agreement(quantized, float_file, int8_file, prompts=args.prompts, steps=args.steps)
    with open(args.text, encoding="utf-8") as f:
        tokens = [default_encoder().eot_token] + default_encoder().encode(f.read())[:args.tokens - 1]
    keras_f, keras_q = (evaluate(m, tokens)["loss"] for m in (model, quantized))
    lite_f, lite_q = litert_loss(float_file, tokens), litert_loss(int8_file, tokens)
    return [
        {"form": "LiteRT int8", "agreement": lite_agree, "loss_f": lite_f, "loss_q": lite_q, "ratio": lite_q / lite_f},
        {"form": "Keras int8 (XLA)", "agreement": keras_agree, "loss_f": keras_f, "loss_q": keras_q,
         "ratio": keras_q / keras_f},
    ], len(tokens)


def notes_of(args, n_tokens):
    weights = ("the model folder's weights" if args.model_dir
               else "random 124M-shaped weights (std 0.1), made by the tool")
    return [f"Weights: {weights}; with random weights the quality figures say how closely int8 follows float32, "
            "not how well either models text.",
            f"Decode: batch 1, after a {args.prompt_len}-token prompt. SavedModel and Keras: the XLA generate loop, "
            f"time per token from {args.long} and {args.short} new tokens, per pair of runs ({args.runs}). LiteRT: "
            f"each of {args.long - 1} decode calls (num_threads: all cores). Load peak: a fresh process's peak RSS once "
            "loaded, its runtime's import included (LiteRT: ai_edge_litert without TensorFlow).",
            f"Quality: int8's argmax along float32's greedy sequence, {args.steps} steps after each of {args.prompts} "
            f"random prompts; mean loss over the first {n_tokens} tokens of {os.path.basename(args.text)}, "
            "int8 / float32."]


def publish(args, argv, rows, quality, n_tokens):
    speed = [report.column("form", "form"), report.column("export_s", "export s", ".1f"),
             report.column("size_mb", "size MB", ".1f"), report.column("load_peak_mb", "load peak RSS MB", ".0f"),
             report.column("ms_per_token", "decode ms per token", ".1f")]
    quality_columns = [report.column("form", "form"), report.column("agreement", "greedy agreement", ".3f"),
                       report.column("loss_f", "float32 loss", ".4f"), report.column("loss_q", "int8 loss", ".4f"),
                       report.column("ratio", "loss ratio", ".4f")]
    settings = {k: getattr(args, k) for k in ("model_dir", "text", "tokens", "prompt_len", "short", "long", "runs",
                                              "prompts", "steps")}
    report.publish(args, "LiteRT and int8", [report.table(speed, rows, "Size, memory, speed"),
                                            report.table(quality_columns, quality, "int8 against float32")],
                   tool=__file__, argv=argv, settings=settings, notes=notes_of(args, n_tokens))


def main(argv=None):
    args = arguments(argv)
    timing = dict(prompt_len=args.prompt_len, short=args.short, long=args.long, runs=args.runs)
    if args.child:
        print(json.dumps(child(*args.child, **timing)))
        return 0
    from tfgpt2.formats.checkpoint import load_model
    from tfgpt2.hparams import published_hparams
    from tfgpt2.testing.checkpoints import make_checkpoint
    with tempfile.TemporaryDirectory(prefix="tfgpt2-litert-bench-") as tmp:
        model_dir = args.model_dir or make_checkpoint(os.path.join(tmp, "124M"), published_hparams("124M"), std=0.1)
        model = load_model(model_dir)
        paths, export_s, quantized = export_forms(model, model_dir, tmp)
        rows = speed_rows(paths, export_s, timing)
        quality, n_tokens = quality_rows(args, model, quantized, paths)
    publish(args, argv, rows, quality, n_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
