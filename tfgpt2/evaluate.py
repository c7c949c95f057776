"""Mean loss, perplexity and bits per byte of a model over a text, as language-model
evaluations report them.

    python -m tfgpt2.evaluate --model_name 124M --dataset wiki.test.raw --stride 512
    python -m tfgpt2.evaluate --model_dir checkpoint/run1 --dataset valid.txt

The text is encoded after an `<|endoftext|>` (so its first token is scored too) and read in
windows of n_ctx tokens that start `--stride` tokens apart: each token is scored once, by the
first window that predicts it, with up to n_ctx - stride tokens of context before it.
"""
import argparse
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from . import data  # noqa: E402
from .checkpoint import load_model  # noqa: E402
from .encoder import get_encoder  # noqa: E402
from .train import token_losses  # noqa: E402


def windows(n_tokens, n_ctx, stride):
    """(begin, end, first): window inputs tokens[begin:end] predict tokens[begin+1:end+1], of
    which those from position `first` on (inside the window) are scored, for a text of
    n_tokens tokens (the leading <|endoftext|> included)."""
    if not 1 <= stride <= n_ctx:
        raise ValueError(f"--stride must be in [1, n_ctx={n_ctx}], got {stride}")
    plan, begin, scored = [], 0, 0  # scored: targets up to this index are scored
    while scored < n_tokens - 1:
        end = min(begin + n_ctx, n_tokens - 1)
        plan.append((begin, end, scored - begin))
        scored, begin = end, begin + stride
    return plan


def evaluate(model, tokens, *, stride=None, n_bytes=None, batch_size=1):
    """{'loss', 'perplexity', 'tokens', and 'bits_per_byte' given the text's UTF-8 size} for
    `tokens` (the leading <|endoftext|> included), the windows compiled at one shape."""
    n_ctx = model.hparams.n_ctx
    tokens = np.asarray(tokens, np.int32)
    plan = windows(len(tokens), n_ctx, stride or n_ctx)
    losses = tf.function(lambda x, y: token_losses(y, model(x)["logits"]), jit_compile=True)
    total, count = 0.0, 0
    for i in range(0, len(plan), batch_size):
        x = np.zeros([batch_size, n_ctx], np.int32)
        y = np.zeros_like(x)
        weight = np.zeros(x.shape, np.float64)
        for row, (begin, end, first) in enumerate(plan[i:i + batch_size]):
            x[row, :end - begin] = tokens[begin:end]
            y[row, :end - begin] = tokens[begin + 1:end + 1]
            weight[row, first:end - begin] = 1
        total += float(np.sum(losses(x, y).numpy() * weight))
        count += int(weight.sum())
    result = {"loss": total / count, "perplexity": math.exp(total / count), "tokens": count}
    if n_bytes:
        result["bits_per_byte"] = total / math.log(2) / n_bytes
    return result


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tfgpt2.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help="a text file")
    p.add_argument("--model_name", default="124M")
    p.add_argument("--models_dir", default="models")
    p.add_argument("--model_dir", help="a model or run folder (instead of --models_dir/--model_name)")
    p.add_argument("--stride", type=int, help="tokens between window starts (default n_ctx: no overlap)")
    p.add_argument("--batch_size", type=int, default=1,
                   help="windows at once (their logits take batch x n_ctx x 50257 floats: 206 MB each for 1024)")
    p.add_argument("--encoding", default="utf-8", help="the text file's encoding")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch_size must be >= 1, got {args.batch_size}")
    model_dir = args.model_dir or os.path.join(args.models_dir, args.model_name)
    try:
        text = data.read_text(args.dataset, args.encoding)
        enc = get_encoder(os.path.basename(os.path.normpath(model_dir)), os.path.dirname(os.path.normpath(model_dir)))
        tokens = [enc.eot_token] + enc.encode(text)
        if len(tokens) < 2:
            raise ValueError(f"{args.dataset}: no text to evaluate")
        model = load_model(model_dir)
        result = evaluate(model, tokens, stride=args.stride, n_bytes=len(text.encode("utf-8")),
                          batch_size=args.batch_size)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"tokens {result['tokens']}  loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  "
          f"bits per byte {result['bits_per_byte']:.4f}")


if __name__ == "__main__":
    main()
