"""Mean loss, perplexity and bits per byte of a model over a text, as language-model
evaluations report them (`tfgpt2 evaluate`).

The text is encoded after an `<|endoftext|>` (so its first token is scored too) and read in
windows of n_ctx tokens that start `--stride` tokens apart: each token is scored once, by the
first window that predicts it, with up to n_ctx - stride tokens of context before it.
"""
import math

import numpy as np
import tensorflow as tf

from .losses import token_losses


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
    losses = tf.function(lambda x, y: token_losses(y, model(x)["logits"]), jit_compile=True, autograph=False)
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
