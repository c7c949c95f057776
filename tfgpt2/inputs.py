"""What `GPT2` takes, checked before anything is gathered: token ids (`as_token_ids`, and
`in_vocabulary`, the one rule for a valid token id, which every entry point asks; `TokenIds`,
GPT2's `__call__` on lists and arrays), `past` (`check_past`) and positions (`check_inputs`)."""
import keras
import numpy as np
import tensorflow as tf


def in_vocabulary(X, n_vocab):
    """Where the token ids X (a tensor, an array or an int) are in [0, n_vocab): the one rule
    for a valid id."""
    if tf.is_tensor(X):
        return tf.logical_and(X >= 0, X < tf.cast(n_vocab, X.dtype))
    return (np.asarray(X) >= 0) & (np.asarray(X) < n_vocab)


def as_token_ids(X):
    """X (a tensor, an array or nested lists) as an integer tensor [batch, time]; anything
    else fails naming its shape or dtype."""
    if isinstance(X, keras.KerasTensor):
        return X
    if not tf.is_tensor(X):
        try:
            array = np.asarray(X)
        except ValueError:
            raise ValueError("token ids must be [batch, time] with rows of equal length; "
                             "got rows of different lengths") from None
        if array.dtype == object:
            raise ValueError("token ids must be [batch, time] with rows of equal length; "
                             "got rows of different lengths or non-numbers")
        if array.size == 0:
            array = array.astype(np.int32)
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
        fits = array.size == 0 or (array.min() >= -2**31 and array.max() < 2**31)
        X = tf.constant(array, tf.int32 if fits else tf.int64)
    if not X.dtype.is_integer:
        raise ValueError(f"token ids must be integers, got dtype {X.dtype.name}")
    if X.shape.rank is not None and X.shape.rank != 2:
        raise ValueError(f"token ids must be [batch, time], got shape {X.shape.as_list()}")
    return X


class TokenIds:
    """`model(X, past)` takes token ids and `past` as lists or arrays too."""

    def __call__(self, X, past=None, **kwargs):
        if past is not None and not isinstance(past, keras.KerasTensor):
            past = tf.convert_to_tensor(past)
        return super().__call__(as_token_ids(X), past, **kwargs)


def check_past(past, expected):
    """`past` as the original's [batch, n_layer, 2, n_head, T, head_dim] (`expected`, its
    `past_shape`); a mismatch in a known dimension fails naming both shapes."""
    shape = past.shape.as_list()
    known = [(e, s) for e, s in zip(expected, shape) if e is not None and s is not None]
    if len(shape) != len(expected) or any(e != s for e, s in known):
        names = "[batch, n_layer, 2, n_head, sequence, n_embd // n_head]"
        raise ValueError(f"past must be {names} = {['?' if e is None else e for e in expected]}, "
                         f"got shape {shape}")
    return past


def check_inputs(X, positions, hparams):
    """Token ids in [0, n_vocab) and positions < n_ctx, per row.

    Returns X and positions, gated by asserts (raised at once in eager mode, by the graph in a
    tf.function, before either is gathered), and `ok` [batch]: false for a row with a bad id or
    position. XLA drops asserts and clamps `tf.gather`'s indices, so the caller turns such rows
    into NaN (never a plausible answer).
    """
    n_vocab, n_ctx = hparams.n_vocab, hparams.n_ctx
    if positions.shape[1] is not None and positions.shape[1] > n_ctx:
        raise ValueError(f"input of {positions.shape[1]} tokens exceeds the context window n_ctx={n_ctx}")
    id_ok = in_vocabulary(X, n_vocab)
    ok = tf.logical_and(tf.reduce_all(id_ok, axis=1), tf.reduce_all(positions < n_ctx, axis=1))
    checks = [
        tf.debugging.assert_less(positions, n_ctx, message=(
            f"input (past + new tokens) exceeds the context window n_ctx={n_ctx}; positions")),
        tf.debugging.Assert(tf.reduce_all(id_ok), [f"token ids must be in [0, n_vocab={n_vocab}); got",
                                                   tf.boolean_mask(X, tf.logical_not(id_ok))[:3]]),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(X), tf.identity(positions), ok
