"""OpenAI's `src/model.py` as Keras 3 layers, with the same names, math and variables.

Each layer's variables carry the checkpoint's names (`model/h0/attn/c_attn/w`, shape
[1, n_embd, 3*n_embd]), so loading and saving are a loop over `model.weights`.

Beyond the original, `GPT2.call` can run over a fixed-size key/value cache written in place
(`cache_index`), with left padding (`pad`); the generation loop in `sample.py` uses that,
and it shares every projection, the mask and the softmax with the original `past` path.
"""
import contextlib
import contextvars

import numpy as np
import tensorflow as tf
import keras
from tensorflow.compiler.tf2xla.python import xla

from .hparams import default_hparams


_INITIALIZE = contextvars.ContextVar("initialize", default=True)
_TRANSPOSED = contextvars.ContextVar("transposed", default={})


@contextlib.contextmanager
def uninitialized():
    """Create variables as zeros instead of random: for a model a checkpoint is loaded into
    (random init of 124M parameters takes seconds and memory for nothing)."""
    token = _INITIALIZE.set(False)
    try:
        yield
    finally:
        _INITIALIZE.reset(token)


@contextlib.contextmanager
def transposed_weights(weights):
    """Inside, each Conv1D in `weights` ({layer: its w as [nf, nx]}) multiplies by that.

    Same values, another memory layout, for the decoding steps of XLA-compiled generation on a
    CPU, which spend their time reading the weights: XLA multiplies a few rows by a [nx, nf]
    weight on one core, and the [nf, nx] copy on all of them (README, Speed). XLA only (it
    needs an optimization barrier). The caller makes the copies (`Generator.transposed`)."""
    token = _TRANSPOSED.set(weights)
    try:
        yield
    finally:
        _TRANSPOSED.reset(token)


def conv1d_layers(model):
    """Every Conv1D of the blocks, in a fixed order."""
    return [conv for block in model.h
            for conv in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)]


def normal(stddev):
    """The original's random_normal_initializer, unless inside `uninitialized()`."""
    return keras.initializers.RandomNormal(stddev=stddev) if _INITIALIZE.get() else "zeros"


def shape_list(x):
    """Static dimensions where known, dynamic ones elsewhere."""
    static = x.shape.as_list()
    dynamic = tf.shape(x)
    return [dynamic[i] if s is None else s for i, s in enumerate(static)]


def softmax(x, axis=-1):
    x = x - tf.reduce_max(x, axis=axis, keepdims=True)
    ex = tf.exp(x)
    return ex / tf.reduce_sum(ex, axis=axis, keepdims=True)


def gelu(x):
    """GELU in its tanh form, as GPT-2 was trained (not the erf form)."""
    return 0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))


class Norm(keras.layers.Layer):
    """norm: LayerNorm over the last axis, epsilon inside the rsqrt, as written in the original."""

    def __init__(self, n_state, *, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.n_state, self.epsilon = n_state, epsilon

    def build(self, input_shape=None):
        self.g = self.add_weight(name="g", shape=[self.n_state], initializer="ones")
        self.b = self.add_weight(name="b", shape=[self.n_state], initializer="zeros")

    def call(self, x):
        u = tf.reduce_mean(x, axis=-1, keepdims=True)
        s = tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True)
        x = (x - u) * tf.math.rsqrt(s + self.epsilon)
        return x * self.g + self.b


def split_states(x, n):
    """Reshape the last dimension of x into [n, x.shape[-1]/n]."""
    *start, m = shape_list(x)
    return tf.reshape(x, start + [n, m // n])


def merge_states(x):
    """Smash the last two dimensions of x into a single dimension."""
    *start, a, b = shape_list(x)
    return tf.reshape(x, start + [a * b])


class Conv1D(keras.layers.Layer):
    """conv1d: a dense layer whose weight keeps the original's [1, nx, nf] shape."""

    def __init__(self, nx, nf, *, w_init_stdev=0.02, **kwargs):
        super().__init__(**kwargs)
        self.nx, self.nf, self.w_init_stdev = nx, nf, w_init_stdev

    def build(self, input_shape=None):
        self.w = self.add_weight(name="w", shape=[1, self.nx, self.nf], initializer=normal(self.w_init_stdev))
        self.b = self.add_weight(name="b", shape=[self.nf], initializer="zeros")

    def call(self, x):
        *start, nx = shape_list(x)
        x = tf.reshape(x, [-1, nx])
        w_t = _TRANSPOSED.get().get(self)
        if w_t is None:
            y = tf.matmul(x, tf.reshape(self.w, [-1, self.nf])) + self.b
        else:
            # (w_t @ x^T)^T: at a few rows XLA on a CPU runs x @ w on one core, and this on all
            # of them. The barrier keeps XLA from rewriting it back into x @ w.
            y = tf.transpose(xla.optimization_barrier(tf.matmul(w_t, x, transpose_b=True))[0]) + self.b
        return tf.reshape(y, start + [self.nf])


def attention_mask(nd, ns, *, dtype, offset=None, pad=None):
    """1's where a query may attend: the lower triangle counted from the lower right corner.

    Query i (of nd) sits at position `offset + i` among the ns keys; offset defaults to
    ns - nd, the original's case. `pad` [batch] masks each row's first pad[r] keys (left
    padding) and makes the mask [batch, nd, ns].
    """
    i = tf.range(nd)[:, None]
    j = tf.range(ns)
    if offset is None:
        offset = ns - nd
    m = i + offset >= j
    if pad is not None:
        m = tf.logical_and(m[None], (j[None, :] >= pad[:, None])[:, None, :])
    return tf.cast(m, dtype)


def write_cache(cache, update, index):
    """cache[:, :, index:index+n] = update, for cache [batch, heads, T, features].

    A scatter, because XLA needs the bounds of a strided-slice update to be constants;
    under XLA it updates the loop's cache buffer in place.
    """
    batch, heads, n, _ = shape_list(update)
    grid = tf.meshgrid(tf.range(batch), tf.range(heads), index + tf.range(n), indexing="ij")
    return tf.tensor_scatter_nd_update(cache, tf.stack(grid, axis=-1), update)


class Attention(keras.layers.Layer):
    """attn: causal multi-head self-attention returning `present` ([k, v] of the new tokens)."""

    def __init__(self, n_state, *, hparams, **kwargs):
        super().__init__(**kwargs)
        assert n_state % hparams.n_head == 0
        self.n_head = hparams.n_head
        self.c_attn = Conv1D(n_state, n_state * 3, name="c_attn")
        self.c_proj = Conv1D(n_state, n_state, name="c_proj")

    def build(self, input_shape=None):
        self.c_attn.build()
        self.c_proj.build()

    def split_heads(self, x):
        # From [batch, sequence, features] to [batch, heads, sequence, features]
        return tf.transpose(split_states(x, self.n_head), [0, 2, 1, 3])

    def merge_heads(self, x):
        return merge_states(tf.transpose(x, [0, 2, 1, 3]))

    def call(self, x, past=None, *, attn_mask, cache_index=None):
        """`past` [batch, 2, heads, sequence, features] is concatenated to, as in the original;
        with `cache_index` it is a pair of fixed-size caches (keys, values), each
        [batch, heads, T_max, features], that the new keys and values are written into, and
        `present` is the pair of updated caches."""
        c = self.c_attn(x)
        q, k, v = map(self.split_heads, tf.split(c, 3, axis=2))
        if cache_index is not None:
            k, v = present = tuple(write_cache(cache, new, cache_index) for cache, new in zip(past, (k, v)))
        else:
            present = tf.stack([k, v], axis=1)
            if past is not None:
                pk, pv = tf.unstack(past, axis=1)
                k = tf.concat([pk, k], axis=-2)
                v = tf.concat([pv, v], axis=-2)
        a = multihead_attn(q, k, v, attn_mask)
        a = self.merge_heads(a)
        return self.c_proj(a), present


def mask_attn_weights(w, b):
    # w is [batch, heads, dst_sequence, src_sequence]; b is [dst, src] or [batch, dst, src].
    b = b[None, None] if b.shape.rank == 2 else b[:, None]
    return w * b - tf.cast(1e10, w.dtype) * (1 - b)


def multihead_attn(q, k, v, mask):
    # q, k, v have shape [batch, heads, sequence, features]
    w = tf.matmul(q, k, transpose_b=True)
    w = w * tf.math.rsqrt(tf.cast(v.shape[-1], w.dtype))
    w = mask_attn_weights(w, mask)
    w = softmax(w)
    return tf.matmul(w, v)


class MLP(keras.layers.Layer):
    """mlp: c_fc to n_state, tanh GELU, c_proj back to nx."""

    def __init__(self, nx, n_state, **kwargs):
        super().__init__(**kwargs)
        self.c_fc = Conv1D(nx, n_state, name="c_fc")
        self.c_proj = Conv1D(n_state, nx, name="c_proj")

    def build(self, input_shape=None):
        self.c_fc.build()
        self.c_proj.build()

    def call(self, x):
        return self.c_proj(gelu(self.c_fc(x)))


class Block(keras.layers.Layer):
    """block: pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, *, hparams, **kwargs):
        super().__init__(**kwargs)
        nx = hparams.n_embd
        self.ln_1 = Norm(nx, name="ln_1")
        self.attn = Attention(nx, hparams=hparams, name="attn")
        self.ln_2 = Norm(nx, name="ln_2")
        self.mlp = MLP(nx, nx * 4, name="mlp")

    def build(self, input_shape=None):
        for layer in (self.ln_1, self.attn, self.ln_2, self.mlp):
            layer.build()

    def call(self, x, past=None, *, attn_mask, cache_index=None):
        a, present = self.attn(self.ln_1(x), past, attn_mask=attn_mask, cache_index=cache_index)
        x = x + a
        m = self.mlp(self.ln_2(x))
        x = x + m
        return x, present


def past_shape(*, hparams, batch_size=None, sequence=None):
    return [batch_size, hparams.n_layer, 2, hparams.n_head, sequence, hparams.n_embd // hparams.n_head]


def positions_for(tokens, past_length, pad=None):
    """Position ids past_length, past_length+1, ... per row; with `pad`, each row counts from
    its first real token (padding slots get position 0, and are masked anyway)."""
    batch_size, nsteps = shape_list(tokens)
    positions = tf.tile((past_length + tf.range(nsteps))[None], [batch_size, 1])
    if pad is None:
        return positions
    return tf.maximum(positions - tf.cast(pad, tf.int32)[:, None], 0)


def check_inputs(X, positions, hparams):
    """Out-of-range ids and positions must fail: `tf.gather` on a GPU returns zeros for them.
    Raises at once in eager mode; in a graph the checks are ops (XLA drops them, so the
    compiled generation checks its inputs before entering XLA)."""
    n_vocab, n_ctx = hparams.n_vocab, hparams.n_ctx
    if isinstance(positions, tf.Tensor) and positions.shape[1] is not None and positions.shape[1] > n_ctx:
        raise ValueError(f"input of {positions.shape[1]} tokens exceeds the context window n_ctx={n_ctx}")
    checks = [
        tf.debugging.assert_less(positions, n_ctx, message=(
            f"input (past + new tokens) exceeds the context window n_ctx={n_ctx}; positions")),
        tf.debugging.assert_non_negative(X, message="token ids must be >= 0; got"),
        tf.debugging.assert_less(X, tf.cast(n_vocab, X.dtype), message=(
            f"token ids must be < n_vocab={n_vocab}; got")),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(X)


class GPT2(keras.Model):
    """model: token and position embeddings, n_layer blocks, a final norm, and logits from the
    token embedding itself (weight tying), unless `tie_embeddings=False` gives the output
    layer its own matrix `model/out_head` [n_vocab, n_embd].

    `model(X, past=None)` returns {'logits': [batch, T, n_vocab],
    'present': [batch, n_layer, 2, n_head, T, n_embd // n_head]} as the original does.
    """

    def __init__(self, hparams=None, *, tie_embeddings=True, name="model", **kwargs):
        super().__init__(name=name, **kwargs)
        self.hparams = (hparams or default_hparams()).validate()
        if self.hparams.n_vocab < 1:
            raise ValueError("hparams.n_vocab must be set (>= 1); read it from hparams.json")
        self.tie_embeddings = tie_embeddings
        self.h = [Block(hparams=self.hparams, name=f"h{layer}") for layer in range(self.hparams.n_layer)]
        self.ln_f = Norm(self.hparams.n_embd, name="ln_f")
        self.build()

    def build(self, input_shape=None):
        hp = self.hparams
        self.wpe = self.add_weight(name="wpe", shape=[hp.n_ctx, hp.n_embd],
                                   initializer=normal(0.01))
        self.wte = self.add_weight(name="wte", shape=[hp.n_vocab, hp.n_embd],
                                   initializer=normal(0.02))
        for block in self.h:
            block.build()
        self.ln_f.build()
        self.out_head = None if self.tie_embeddings else self.add_weight(
            name="out_head", shape=[hp.n_vocab, hp.n_embd],
            initializer=normal(0.02))

    def call(self, X, past=None, *, pad=None, cache_index=None, last_only=False, return_hidden=False):
        """`past` as in the original. With `cache_index`, `past` is instead a list of per-layer
        (keys, values) caches, each [batch, n_head, T_max, head_dim] (separate tensors, so that
        XLA updates each in place and never slices them), that X's keys and values are written
        into at slot `cache_index`, and 'present' is the list of updated caches. `pad` [batch] counts each row's left-padding slots.
        `last_only` computes logits for the last position only (all that generation needs:
        a long prompt's logits cost more than its forward pass). `return_hidden` adds 'hidden'
        [batch, n_layer, T, n_embd], the residual stream after each block."""
        hp = self.hparams
        results = {}
        X = tf.convert_to_tensor(X)
        batch, sequence = shape_list(X)
        if cache_index is not None:
            pasts, past_length, ns = past, cache_index, tf.shape(past[0][0])[-2]
        else:
            pasts = tf.unstack(past, axis=1) if past is not None else [None] * hp.n_layer
            past_length = 0 if past is None else tf.shape(past)[-2]
            ns = past_length + sequence
        assert len(pasts) == hp.n_layer
        positions = positions_for(X, past_length, pad)
        if cache_index is None:  # generation checks its inputs before XLA, which drops asserts
            X = check_inputs(X, positions, hp)
        h = tf.gather(self.wte, X) + tf.gather(self.wpe, positions)
        mask = attention_mask(sequence, ns, dtype=h.dtype, offset=past_length, pad=pad)

        presents, hidden = [], []
        for block, layer_past in zip(self.h, pasts):
            h, present = block(h, layer_past, attn_mask=mask, cache_index=cache_index)
            presents.append(present)
            hidden.append(h)
        results["present"] = presents if cache_index is not None else tf.stack(presents, axis=1)
        if return_hidden:
            results["hidden"] = tf.stack(hidden, axis=1)
        if last_only:
            h, sequence = h[:, -1:], 1
        h = self.ln_f(h)

        # Language model loss.  Do tokens <n predict token n?
        h_flat = tf.reshape(h, [batch * sequence, hp.n_embd])
        logits = tf.matmul(h_flat, self.wte if self.tie_embeddings else self.out_head, transpose_b=True)
        results["logits"] = tf.reshape(logits, [batch, sequence, hp.n_vocab])
        return results

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """`fit`/`evaluate`: a plain loss sees the logits alone (`present` is never built
        in a compiled step whose outputs do not use it); a loss keyed 'logits' still works."""
        return super().compute_loss(x, y, self._logits_for_loss(y_pred), sample_weight, training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, self._logits_for_loss(y_pred), sample_weight)

    def _logits_for_loss(self, y_pred):
        return y_pred["logits"] if isinstance(y_pred, dict) and not isinstance(self.loss, dict) else y_pred
