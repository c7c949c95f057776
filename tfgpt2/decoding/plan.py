"""What generation checks and plans before anything is compiled: the request checks, each
naming what is wrong, and the length buckets that bound how often XLA compiles.

The checks (`check_request`) and the planner (`plan`) are TensorFlow ops, shared by
`tfgpt2.generate` (eagerly: a failed check raises ValueError at once) and the SavedModel's
`generate` signature (in its graph, before XLA, which would clamp a bad id silently).
"""
import numbers

import numpy as np
import tensorflow as tf

from ..model import in_vocabulary


def fits(prompt_tokens, length, n_ctx):
    """The one rule for lengths, the original's: prompt + length - 1 <= n_ctx (the last new
    token is never fed back). Python ints or tensors."""
    return prompt_tokens + length - 1 <= n_ctx


def bucket(n, *, minimum=16):
    """The length bucket for n: the first of 16, 24, 32, 48, 64, 96, ... (powers of two and
    1.5 times them) that holds it, so that padding wastes less than a third."""
    size = minimum
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def _bucket_of(n, largest):
    """`bucket(n)` as a tensor, for 1 <= n <= largest."""
    sizes = tf.constant(sorted({bucket(m) for m in range(1, largest + 1)}))
    return tf.reduce_min(tf.where(sizes >= n, sizes, sizes[-1]))


def plan(longest, length, n_ctx, *, one_alone=True):
    """(prompt_len, total) for prompts of at most `longest` tokens and `length` new ones: the
    prompts are left-padded to prompt_len, and the token buffer and cache hold total. For a
    request that `check_request` passed; ints or int32 tensors. With `one_alone`, one-token
    prompts (the sample scripts' start token) get a prompt_len of 1: nothing to run before the
    loop, so nothing more to compile. The SavedModel, whose loop is traced once for prompts of
    any length and so always runs the prompt first, plans without it."""
    prompt_len = tf.minimum(_bucket_of(longest, n_ctx), n_ctx)
    if one_alone:
        prompt_len = tf.where(tf.equal(longest, 1), 1, prompt_len)
    total = tf.minimum(_bucket_of(prompt_len + length, 2 * n_ctx), prompt_len + n_ctx)
    return prompt_len, total


def require(ok, message, *data):
    """A check: eagerly, raises ValueError(message: data) at once when `ok` is not all true;
    in a graph, an assert op to gate results on (its message and data in the error)."""
    ok = tf.reduce_all(ok)
    if tf.executing_eagerly():
        if not bool(ok):
            shown = ", ".join(str(np.asarray(d).tolist()) for d in data)
            raise ValueError(message + (f"; got {shown}" if data else ""))
        return tf.no_op()
    return tf.debugging.Assert(ok, [message, *data] if data else [message])


def check_request(ids, lengths, length, temperature, top_k, top_p, *, hparams):
    """The checks of a generation request, each naming what is wrong: `ids` [batch, P]
    (padding slots hold 0), `lengths` [batch] real tokens per row, `length` new tokens.
    Overflow-proof: any int32 values pass or fail here, never wrap. Returns ops (graph)."""
    n_vocab, n_ctx = hparams.n_vocab, hparams.n_ctx
    lengths64, length64 = tf.cast(lengths, tf.int64), tf.cast(length, tf.int64)
    bad_id = tf.logical_not(in_vocabulary(ids, n_vocab))
    longest = tf.reduce_max(tf.concat([lengths64, [0]], 0))
    return [
        require(tf.size(lengths) > 0, "there must be at least one prompt"),
        require(lengths > 0, "every prompt needs at least one token (use start_token for none)"),
        require(tf.logical_not(bad_id), f"token ids must be in [0, n_vocab={n_vocab})",
                tf.boolean_mask(ids, bad_id)[:3]),
        require(length64 >= 1, "length (max_new_tokens) must be >= 1", length),
        require(fits(longest, length64, n_ctx),
                f"prompt tokens + length (max_new_tokens) - 1 must be <= n_ctx={n_ctx}; "
                "longest prompt and length", longest, length),
        require(tf.logical_and(tf.math.is_finite(temperature), temperature >= 0),
                "temperature must be a finite number >= 0", temperature),
        require(top_k >= 0, "top_k must be >= 0", top_k),
        require(tf.logical_and(top_p >= 0, top_p <= 1), "top_p must be in [0, 1]", top_p),
    ]


# ---- the library's arguments, checked in Python before any tensor is made ----------------

def integer(name, value, *, low=None, high=None):
    """value as an int, or a ValueError naming `name`: floats, bools and strings are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if high is None and low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value}")
    return value


def real(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def prompt_rows(prompts):
    """Each prompt as a 1-D int64 array; non-integer ids fail naming the prompt."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token lists")
    rows = []
    for row, p in enumerate(prompts):
        try:
            array = np.asarray(p)
        except ValueError:
            raise ValueError(f"prompt {row}: not a flat list of token ids") from None
        if array.size == 0:
            array = array.astype(np.int64)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"prompt {row}: token ids must be a flat list of integers, "
                             f"got dtype {array.dtype} and shape {list(array.shape)}")
        rows.append(array.astype(np.int64))
    return rows


