"""OpenAI's `src/model.py` as Keras 3 layers, with the same names, math and variables.

Each layer's variables carry the checkpoint's names (`model/h0/attn/c_attn/w`, shape
[1, n_embd, 3*n_embd]), so loading and saving are a loop over `model.weights`.

`GPT2.call(X, past)` is the original's `model()`, and `window_loss` the forks' training loss.
Generation runs the same layers over a fixed-size key/value cache (`tfgpt2.decoding.cache`),
sharing every projection, the mask and the softmax; nothing here knows about it. Beside this
file: the written-out gradients (`gradients.py`), LoRA and int8 (`adapters.py`), the checks of
the inputs (`inputs.py`) and the float32-exact products (`products.py`).

Keras dtype policies (`GPT2(hparams, dtype="mixed_bfloat16")`, "bfloat16", "float16", ...)
reach every layer: variables in the policy's variable dtype, matmuls and the residual stream
in its compute dtype, LayerNorm statistics and the attention softmax in float32, and the
logits always returned as float32. Under float32 the math is the original's, op for op, but for
the attention softmax, TensorFlow's one kernel for the original's exp(w - max) / sum.
"""
import functools

import numpy as np
import tensorflow as tf
import keras

from .adapters import Conv1DAdapters, GPT2Adapters
from .gradients import attn_probs_grad, cross_entropy, gelu_grad, normalize_grad, recompute, written
from .hparams import as_hparams, default_hparams
from .inputs import as_token_ids, check_inputs, check_past, in_vocabulary
from .products import matmul


def normal(stddev, initialize=True):
    """The original's random_normal_initializer; `uninitialized` for a model a checkpoint is
    loaded into (random init of 124M parameters takes seconds and memory for nothing)."""
    return keras.initializers.RandomNormal(stddev=stddev) if initialize else uninitialized


def uninitialized(shape, dtype=None):
    """Memory never written, so never resident until loading writes it, a block of rows at a
    time (`checkpoint.load_weights`): a load peaks at the weights plus one block."""
    return tf.raw_ops.Empty(shape=shape, dtype=dtype or "float32", init=False)


def shape_list(x):
    """Static dimensions where known, dynamic ones elsewhere."""
    static = x.shape.as_list()
    dynamic = tf.shape(x)
    return [dynamic[i] if s is None else s for i, s in enumerate(static)]


@written(gelu_grad)
def gelu(x):
    """GELU in its tanh form, as GPT-2 was trained (not the erf form); the gradient: `gelu_grad`."""
    return 0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3)))), (x,)


def serializable(cls):
    """Register a layer for `keras.models.load_model`, under the package name tfgpt2."""
    return keras.saving.register_keras_serializable(package="tfgpt2")(cls)


@written(normalize_grad)
def normalize(x, epsilon):
    """(x - mean) * rsqrt(variance + epsilon) over the last axis; the gradient: `normalize_grad`."""
    u = tf.reduce_mean(x, axis=-1, keepdims=True)
    r = tf.math.rsqrt(tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True) + epsilon)
    y = (x - u) * r
    return y, (y, r)


@serializable
class Norm(keras.layers.Layer):
    """norm: LayerNorm over the last axis, epsilon inside the rsqrt, as written in the original."""

    def __init__(self, n_state, *, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.n_state, self.epsilon = n_state, epsilon

    def build(self, input_shape=None):
        self.g = self.add_weight(name="g", shape=[self.n_state], initializer="ones")
        self.b = self.add_weight(name="b", shape=[self.n_state], initializer="zeros")

    def call(self, x):
        x = normalize(tf.cast(x, tf.float32), self.epsilon)  # the statistics in float32 under any dtype policy
        return tf.cast(x, self.compute_dtype) * self.g + self.b

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "n_state": self.n_state, "epsilon": self.epsilon}


def split_states(x, n):
    """Reshape the last dimension of x into [n, x.shape[-1]/n]."""
    *start, m = shape_list(x)
    return tf.reshape(x, start + [n, m // n])


def merge_states(x):
    """Smash the last two dimensions of x into a single dimension."""
    *start, a, b = shape_list(x)
    return tf.reshape(x, start + [a * b])


@serializable
class Conv1D(Conv1DAdapters, keras.layers.Layer):
    """conv1d: a dense layer whose weight keeps the original's [1, nx, nf] shape (LoRA and int8:
    `adapters.Conv1DAdapters`)."""

    def __init__(self, nx, nf, *, w_init_stdev=0.02, initialize=True, tf32=False, **kwargs):
        super().__init__(**kwargs)
        self.nx, self.nf, self.w_init_stdev, self.initialize = nx, nf, w_init_stdev, initialize
        self.tf32 = tf32  # `products.matmul`'s: TensorFloat-32 allowed

    def build(self, input_shape=None):
        if self.quantization_mode:  # int8 (`adapters`)
            self.quantized_build(input_shape, self.quantization_mode)
        else:
            self.w = self.add_weight(name="w", shape=[1, self.nx, self.nf],
                                     initializer=normal(self.w_init_stdev, self.initialize))
        self.b = self.add_weight(name="b", shape=[self.nf], initializer="zeros")

    def call(self, x):
        *start, nx = shape_list(x)
        x = tf.reshape(x, [-1, nx])
        y = matmul(x, tf.reshape(self.w, [-1, self.nf]), tf32=self.tf32) + self.b
        if self.lora_enabled:
            y += self.lora_output(x)
        return tf.reshape(y, start + [self.nf])

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.nf)

    def get_config(self):
        return {**super().get_config(), "nx": self.nx, "nf": self.nf, "w_init_stdev": self.w_init_stdev,
                "tf32": self.tf32}


def attention_mask(nd, ns, *, dtype, offset=None):
    """1's where a query may attend: the lower triangle counted from the lower right corner.
    Query i (of nd) sits at position `offset + i` among the ns keys; offset defaults to
    ns - nd, the original's case."""
    i = tf.range(nd)[:, None]
    j = tf.range(ns)
    if offset is None:
        offset = ns - nd
    m = i + offset >= j
    return tf.cast(m, dtype)


@serializable
class Attention(keras.layers.Layer):
    """attn: causal multi-head self-attention returning `present` ([k, v] of the new tokens)."""

    def __init__(self, n_state, *, hparams, initialize=True, tf32=False, **kwargs):
        super().__init__(**kwargs)
        hparams = as_hparams(hparams)
        assert n_state % hparams.n_head == 0
        self.n_state, self.hparams, self.n_head, self.tf32 = n_state, hparams, hparams.n_head, tf32
        self.c_attn = Conv1D(n_state, n_state * 3, initialize=initialize, tf32=tf32, name="c_attn",
                             dtype=self.dtype_policy)
        self.c_proj = Conv1D(n_state, n_state, initialize=initialize, tf32=tf32, name="c_proj", dtype=self.dtype_policy)

    def build(self, input_shape=None):
        self.c_attn.build(input_shape)
        self.c_proj.build(input_shape)

    def compute_output_shape(self, input_shape):
        batch, sequence, _ = input_shape
        return input_shape, (batch, 2, self.n_head, sequence, self.n_state // self.n_head)

    def get_config(self):
        return {**super().get_config(), "n_state": self.n_state, "hparams": self.hparams.values(), "tf32": self.tf32}

    def split_heads(self, x):
        # From [batch, sequence, features] to [batch, heads, sequence, features]
        return tf.transpose(split_states(x, self.n_head), [0, 2, 1, 3])

    def merge_heads(self, x):
        return merge_states(tf.transpose(x, [0, 2, 1, 3]))

    def call(self, x, past=None, *, attn_mask):
        """`past` [batch, 2, heads, sequence, features] is concatenated to, as in the original;
        `present` is [k, v] of x."""
        c = self.c_attn(x)
        q, k, v = map(self.split_heads, tf.split(c, 3, axis=2))
        present = tf.stack([k, v], axis=1)
        if past is not None:
            pk, pv = tf.unstack(past, axis=1)
            k = tf.concat([pk, k], axis=-2)
            v = tf.concat([pv, v], axis=-2)
        a = multihead_attn(q, k, v, attn_mask, tf32=self.tf32)
        a = self.merge_heads(a)
        return self.c_proj(a), present


def heads_mask(b, dtype):
    """The mask [dst, src] or [batch, dst, src] as [1 or batch, 1, dst, src], for all heads."""
    return tf.cast(b[None, None] if b.shape.rank == 2 else b[:, None], dtype)


def mask_attn_weights(w, b, scale=1):
    # w is [batch, heads, dst_sequence, src_sequence]. The original's w * scale, then
    # w * b - 1e10 * (1 - b), as w * (b * scale) - 1e10 * (1 - b): for b of 0 and 1 the same
    # numbers, in one pass over w fewer.
    b = heads_mask(b, w.dtype)
    # the original's 1e10, or float16's largest value (1e10 overflows float16 into inf * 0 = NaN)
    return w * (b * scale) - tf.cast(min(1e10, float(w.dtype.max)), w.dtype) * (1 - b)


@written(attn_probs_grad)
def attn_probs(w, mask, features):
    """softmax(mask_attn_weights(w * rsqrt(features))) in float32, returned in w's dtype, for
    w = q @ k^T [batch, heads, dst_sequence, src_sequence]: TensorFlow's softmax kernel (the
    original's exp(w - max) / sum, in one operation); the gradient: `attn_probs_grad`."""
    scale = tf.math.rsqrt(tf.cast(features, tf.float32))
    y = tf.nn.softmax(mask_attn_weights(tf.cast(w, tf.float32), mask, scale))
    return tf.cast(y, w.dtype), (y, heads_mask(mask, tf.float32) * scale)


def multihead_attn(q, k, v, mask, *, tf32=False):
    # q, k, v have shape [batch, heads, sequence, features]
    w = attn_probs(matmul(q, k, transpose_b=True, tf32=tf32), mask, v.shape[-1])
    return matmul(w, v, tf32=tf32)


@serializable
class MLP(keras.layers.Layer):
    """mlp: c_fc to n_state, tanh GELU, c_proj back to nx."""

    def __init__(self, nx, n_state, *, initialize=True, tf32=False, **kwargs):
        super().__init__(**kwargs)
        self.c_fc = Conv1D(nx, n_state, initialize=initialize, tf32=tf32, name="c_fc", dtype=self.dtype_policy)
        self.c_proj = Conv1D(n_state, nx, initialize=initialize, tf32=tf32, name="c_proj", dtype=self.dtype_policy)

    def build(self, input_shape=None):
        self.c_fc.build(input_shape)
        self.c_proj.build(input_shape and self.c_fc.compute_output_shape(input_shape))

    def call(self, x):
        return self.c_proj(gelu(self.c_fc(x)))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "nx": self.c_fc.nx, "n_state": self.c_fc.nf, "tf32": self.c_fc.tf32}


@serializable
class Block(keras.layers.Layer):
    """block: pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, *, hparams, initialize=True, tf32=False, **kwargs):
        super().__init__(**kwargs)
        self.hparams = hparams = as_hparams(hparams)
        nx = hparams.n_embd
        dtype = self.dtype_policy
        self.ln_1 = Norm(nx, name="ln_1", dtype=dtype)
        self.attn = Attention(nx, hparams=hparams, initialize=initialize, tf32=tf32, name="attn", dtype=dtype)
        self.ln_2 = Norm(nx, name="ln_2", dtype=dtype)
        self.mlp = MLP(nx, nx * 4, initialize=initialize, tf32=tf32, name="mlp", dtype=dtype)

    def build(self, input_shape=None):
        for layer in (self.ln_1, self.attn, self.ln_2, self.mlp):
            layer.build(input_shape)

    def call(self, x, past=None, *, attn_mask):
        a, present = self.attn(self.ln_1(x), past, attn_mask=attn_mask)
        x = x + a
        m = self.mlp(self.ln_2(x))
        x = x + m
        return x, present

    def compute_output_shape(self, input_shape):
        return self.attn.compute_output_shape(input_shape)

    def get_config(self):
        return {**super().get_config(), "hparams": self.hparams.values(), "tf32": self.attn.tf32}


def past_shape(*, hparams, batch_size=None, sequence=None):
    return [batch_size, hparams.n_layer, 2, hparams.n_head, sequence, hparams.n_embd // hparams.n_head]


def positions_for(tokens, past_length):
    batch_size, nsteps = shape_list(tokens)
    return tf.tile((past_length + tf.range(nsteps))[None], [batch_size, 1])


@serializable
class GPT2(GPT2Adapters, keras.Model):
    """model: token and position embeddings, n_layer blocks, a final norm, and logits from the
    token embedding itself (weight tying), unless `tie_embeddings=False` gives the output
    layer its own matrix `model/out_head` [n_vocab, n_embd].

    `model(X, past=None)` returns {'logits': [batch, T, n_vocab],
    'present': [batch, n_layer, 2, n_head, T, n_embd // n_head]} as the original does.
    `initialize=False` leaves the variables unwritten, for a checkpoint to be loaded into.
    `dtype`: a Keras dtype policy ("float32", "bfloat16", "float16", "mixed_bfloat16",
    "mixed_float16"); `present` comes in its compute dtype, the logits always in float32.
    `remat=True` keeps only each block's input for the backward pass and recomputes the rest
    (`gradients.recompute`): less memory for fine-tuning, one more forward pass of time.
    `lora`: the arguments of `enable_lora` ({"rank", "alpha", "targets"}: `adapters`), as
    `get_config` records them. `tf32=True` lets float32 products use TensorFloat-32 where
    TensorFlow's settings allow it (NVIDIA GPUs from Ampere on: faster, less exact); by default
    they are full float32 on every device (`tfgpt2.products`, docs/precision.md).

    Saved the Keras way (`model.save("x.keras")`), it loads with `keras.models.load_model`
    wherever `tfgpt2.model` has been imported (which registers it).
    """

    def __init__(self, hparams=None, *, tie_embeddings=True, initialize=True, remat=False, lora=None, tf32=False,
                 name="model", **kwargs):
        super().__init__(name=name, **kwargs)
        self.remat, self.tf32 = remat, bool(tf32)
        self.hparams = as_hparams(hparams or default_hparams()).validate()
        if self.hparams.n_vocab < 1:
            raise ValueError("hparams.n_vocab must be set (>= 1); read it from hparams.json")
        self.tie_embeddings, self.initialize = tie_embeddings, initialize
        self.h = [Block(hparams=self.hparams, initialize=initialize, tf32=self.tf32, name=f"h{layer}",
                        dtype=self.dtype_policy) for layer in range(self.hparams.n_layer)]
        self.ln_f = Norm(self.hparams.n_embd, name="ln_f", dtype=self.dtype_policy)
        self.build()
        if lora:
            self.enable_lora(lora["rank"], lora["targets"], lora_alpha=lora["alpha"])

    def build(self, input_shape=None):
        hp = self.hparams
        self.wpe = self.add_weight(name="wpe", shape=[hp.n_ctx, hp.n_embd],
                                   initializer=normal(0.01, self.initialize))
        self.wte = self.add_weight(name="wte", shape=[hp.n_vocab, hp.n_embd],
                                   initializer=normal(0.02, self.initialize))
        for block in self.h:
            block.build((None, None, hp.n_embd))
        self.ln_f.build((None, None, hp.n_embd))
        self.out_head = None if self.tie_embeddings else self.add_weight(
            name="out_head", shape=[hp.n_vocab, hp.n_embd],
            initializer=normal(0.02, self.initialize))

    def get_config(self):
        return self.with_quantized_dtype({
            **super().get_config(), "hparams": self.hparams.values(), "tie_embeddings": self.tie_embeddings,
            "tf32": self.tf32, **({"lora": self.lora} if self.lora else {})})

    def __call__(self, X, past=None, **kwargs):
        """As Keras's, taking token ids and `past` as lists or arrays too."""
        if past is not None and not isinstance(past, keras.KerasTensor):
            past = tf.convert_to_tensor(past)
        return super().__call__(as_token_ids(X), past, **kwargs)

    def call(self, X, past=None, *, return_hidden=False):
        """The original's model(): `past` as it. `return_hidden` adds 'hidden'
        [batch, n_layer, T, n_embd], the residual stream after each block.

        A row with a token id outside [0, n_vocab) or a position past n_ctx raises (eager,
        tf.function), or, under XLA, which cannot raise, comes out as NaN."""
        hp = self.hparams
        batch, sequence = shape_list(X)
        if past is not None:
            past = check_past(past, past_shape(hparams=hp, batch_size=batch if isinstance(batch, int) else None))
        past_length = 0 if past is None else shape_list(past)[-2]
        pasts = tf.unstack(past, axis=1) if past is not None else [None] * hp.n_layer
        positions = positions_for(X, past_length)
        X, positions, ok = check_inputs(X, positions, hp)
        h = tf.gather(self.wte, X) + tf.gather(self.wpe, positions)
        h = tf.where(ok[:, None, None], h, tf.constant(np.nan, h.dtype))
        # The offset read from X (times 0), so that the mask is computed at run time: one known
        # while tracing is folded into a constant, of which XLA's bridge gives every op reading it
        # its own copy (124M's remat step at 1 x 1023 tokens compiled 60 of 4 MB, 0.8 GB more peak).
        offset = past_length + 0 * tf.cast(tf.reduce_min(X[:1, :1]), tf.int32)
        mask = attention_mask(sequence, past_length + sequence, dtype=h.dtype, offset=offset)

        presents, hidden = [], []
        for block, layer_past in zip(self.h, pasts):
            run = functools.partial(block, past=layer_past, attn_mask=mask)
            h, present = (recompute(run) if self.remat else run)(h)
            presents.append(present)
            hidden.append(h)
        results = {"present": tf.stack(presents, axis=1), "logits": self.lm_logits(h)}
        if return_hidden:
            results["hidden"] = tf.stack(hidden, axis=1)
        return results

    def as_compute(self, variable):
        """A model-level variable in the compute dtype (Keras autocasts only inside `__call__`)."""
        return tf.cast(variable, self.compute_dtype)

    def lm_logits(self, h):
        """The final norm, then logits from `wte` (or `out_head`): [batch, T, n_vocab] float32."""
        hp = self.hparams
        batch, sequence, _ = shape_list(h)
        h = self.ln_f(h)

        # Language model loss.  Do tokens <n predict token n?
        h_flat = tf.reshape(h, [batch * sequence, hp.n_embd])
        wte = self.wte if self.tie_embeddings else self.out_head
        logits = matmul(h_flat, self.as_compute(wte), transpose_b=True, tf32=self.tf32)
        return tf.reshape(tf.cast(logits, tf.float32), [batch, sequence, hp.n_vocab])

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """`fit`/`evaluate`: a plain loss sees the logits alone (`present` is never built
        in a compiled step whose outputs do not use it); a loss keyed 'logits' still works."""
        return super().compute_loss(x, y, self._logits_for_loss(y_pred), sample_weight, training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, self._logits_for_loss(y_pred), sample_weight)

    def _logits_for_loss(self, y_pred):
        return y_pred["logits"] if isinstance(y_pred, dict) and not isinstance(self.loss, dict) else y_pred


# ---- the loss -----------------------------------------------------------------------------

def token_losses(labels, logits):
    """Softmax cross-entropy of each position, in float32 whatever the logits' dtype, its
    gradient written out (`gradients.cross_entropy`). NaN for a label outside [0, n_vocab),
    which `tf.gather` would clamp under XLA."""
    labels = tf.cast(labels, tf.int32)
    ok = in_vocabulary(labels, tf.shape(logits)[-1])
    return tf.where(ok, cross_entropy(logits, tf.where(ok, labels, 0)), np.nan)


def lm_loss(labels, logits):
    """The forks' loss: the mean cross-entropy of each position's logits against the next token
    (`labels` = tokens[:, 1:] for logits of tokens[:, :-1]). A plain Keras loss for `fit`."""
    return tf.reduce_mean(token_losses(labels, logits))


def window_loss(model, tokens):
    """The loss of windows [batch, length]: the model reads length - 1 tokens and predicts the
    next of each (the forks read all `length` and drop the last position's logits: the same)."""
    return lm_loss(tokens[:, 1:], model(tokens[:, :-1])["logits"])
