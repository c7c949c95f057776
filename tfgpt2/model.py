"""OpenAI's `src/model.py` as Keras 3 layers, with its names, math and variables (loading and
saving are a loop over `model.weights`); `GPT2.call(X, past)` is its `model()`. Beside it: one
adapter per thing the layers take on (`adapters/`), the written-out gradients (`gradients.py`),
the checks of the inputs (`inputs.py`), the float32-exact products (`products.py`).

A Keras dtype policy (`GPT2(hparams, dtype="mixed_bfloat16")`) reaches every layer: products
and the residual stream in its compute dtype, LayerNorm statistics, the attention softmax and
GELU in float32, the logits float32. Under float32 the math is the original's, op for op, but
for the softmax: TensorFlow's one kernel for the original's exp(w - max) / sum.
"""
import numpy as np
import tensorflow as tf
import keras

from .adapters import Config, Fit, Int8, Int8Model, Layer, LoRA, LoRAModel, Remat, TF32, Unwritten
from .gradients import attn_probs_grad, gelu_grad, normalize_grad, written
from .hparams import as_hparams, default_hparams
from .inputs import TokenIds, check_inputs, check_past
from .products import matmul


def shape_list(x):
    """Static dimensions where known, dynamic ones elsewhere."""
    static = x.shape.as_list()
    dynamic = tf.shape(x)
    return [dynamic[i] if s is None else s for i, s in enumerate(static)]


@written(gelu_grad)
def gelu(x):
    """GELU in its tanh form, as GPT-2 was trained (not the erf form), in float32 under any dtype
    policy; the gradient: `gelu_grad`."""
    x32 = tf.cast(x, tf.float32)
    return tf.cast(0.5 * x32 * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x32 + 0.044715 * tf.pow(x32, 3)))), x.dtype), (x,)


@written(normalize_grad)
def normalize(x, epsilon):
    """(x - mean) * rsqrt(variance + epsilon) over the last axis; the gradient: `normalize_grad`."""
    u = tf.reduce_mean(x, axis=-1, keepdims=True)
    r = tf.math.rsqrt(tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True) + epsilon)
    y = (x - u) * r
    return y, (y, r)


class Norm(Layer):
    """norm: LayerNorm over the last axis, epsilon inside the rsqrt, as written in the original."""

    CONFIG = ("n_state", "epsilon")

    def __init__(self, n_state, *, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.n_state, self.epsilon = n_state, epsilon

    def build(self, input_shape=None):
        self.g = self.add_weight(name="g", shape=[self.n_state], initializer="ones")
        self.b = self.add_weight(name="b", shape=[self.n_state], initializer="zeros")

    def call(self, x):
        x = normalize(tf.cast(x, tf.float32), self.epsilon)  # the statistics in float32 under any dtype policy
        return tf.cast(x, self.compute_dtype) * self.g + self.b


def split_states(x, n):
    """Reshape the last dimension of x into [n, x.shape[-1]/n]."""
    *start, m = shape_list(x)
    return tf.reshape(x, start + [n, m // n])


def merge_states(x):
    """Smash the last two dimensions of x into a single dimension."""
    *start, a, b = shape_list(x)
    return tf.reshape(x, start + [a * b])


class Conv1D(LoRA, Int8, TF32, Unwritten, Layer):
    """conv1d: a dense layer whose weight keeps the original's [1, nx, nf] shape."""

    CONFIG = ("nx", "nf", "w_init_stdev")

    def __init__(self, nx, nf, *, w_init_stdev=0.02, **kwargs):
        super().__init__(**kwargs)
        self.nx, self.nf, self.w_init_stdev = nx, nf, w_init_stdev

    def build(self, input_shape=None):
        if self.quantization_mode:  # Keras' protocol, as Dense's: a quantized layer builds its own `w`
            self.quantized_build(input_shape, self.quantization_mode)
        else:
            self.w = self.add_weight(name="w", shape=[1, self.nx, self.nf], initializer=self.normal(self.w_init_stdev))
        self.b = self.add_weight(name="b", shape=[self.nf], initializer="zeros")

    def call(self, x):
        *start, nx = shape_list(x)
        c = matmul(tf.reshape(x, [-1, nx]), tf.reshape(self.w, [-1, self.nf]), tf32=self.tf32) + self.b
        return tf.reshape(c, start + [self.nf])

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.nf)


def attention_mask(nd, ns, *, dtype, offset=None):
    """1's in the lower triangle, counted from the lower right corner: query i (of nd) at
    position `offset + i` among the ns keys (offset ns - nd by default, the original's case)."""
    i = tf.range(nd)[:, None]
    j = tf.range(ns)
    if offset is None:
        offset = ns - nd
    m = i + offset >= j
    return tf.cast(m, dtype)


class Attention(TF32, Layer):
    """attn: causal multi-head self-attention returning `present` ([k, v] of the new tokens)."""

    CONFIG = ("n_state", "hparams")

    def __init__(self, n_state, *, hparams, **kwargs):
        super().__init__(**kwargs)
        hparams = as_hparams(hparams)
        assert n_state % hparams.n_head == 0
        self.n_state, self.hparams, self.n_head = n_state, hparams, hparams.n_head
        self.c_attn = Conv1D(n_state, n_state * 3, name="c_attn", dtype=self.dtype_policy)
        self.c_proj = Conv1D(n_state, n_state, name="c_proj", dtype=self.dtype_policy)

    def compute_output_shape(self, input_shape):
        batch, sequence, _ = input_shape
        return input_shape, (batch, 2, self.n_head, sequence, self.n_state // self.n_head)

    def split_heads(self, x):
        # From [batch, sequence, features] to [batch, heads, sequence, features]
        return tf.transpose(split_states(x, self.n_head), [0, 2, 1, 3])

    def merge_heads(self, x):
        return merge_states(tf.transpose(x, [0, 2, 1, 3]))

    def call(self, x, past=None, *, attn_mask):
        """`past` [batch, 2, heads, T, features] is concatenated to, as in the original; `present`: [k, v] of x."""
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


def mask_attn_weights(w, b, scale=1):
    # w is [batch, heads, dst, src], b (w's dtype) [dst, src] or [1 or batch, 1, dst, src]. The original's
    # w * scale, then w * b - 1e10 * (1 - b), as w * (b * scale) - 1e10 * (1 - b): one pass fewer.
    # the original's 1e10, or float16's largest value (1e10 overflows float16 into inf * 0 = NaN)
    return w * (b * scale) - tf.cast(min(1e10, float(w.dtype.max)), w.dtype) * (1 - b)


@written(attn_probs_grad)
def attn_probs(w, mask, features):
    """softmax(mask_attn_weights(w * rsqrt(features))) in float32, in w's dtype, for w = q @ k^T
    and a mask [dst, src] or [batch, dst, src]; the gradient: `attn_probs_grad`."""
    scale = tf.math.rsqrt(tf.cast(features, tf.float32))
    b = tf.cast(mask[None, None] if mask.shape.rank == 2 else mask[:, None], tf.float32)  # for all heads
    y = tf.nn.softmax(mask_attn_weights(tf.cast(w, tf.float32), b, scale))
    return tf.cast(y, w.dtype), (y, b * scale)


def multihead_attn(q, k, v, mask, *, tf32=False):
    # q, k, v have shape [batch, heads, sequence, features]
    w = attn_probs(matmul(q, k, transpose_b=True, tf32=tf32), mask, v.shape[-1])
    return matmul(w, v, tf32=tf32)


class MLP(Layer):
    """mlp: c_fc to n_state, tanh GELU, c_proj back to nx."""

    CONFIG = ("nx", "n_state")

    def __init__(self, nx, n_state, **kwargs):
        super().__init__(**kwargs)
        self.nx, self.n_state = nx, n_state
        self.c_fc = Conv1D(nx, n_state, name="c_fc", dtype=self.dtype_policy)
        self.c_proj = Conv1D(n_state, nx, name="c_proj", dtype=self.dtype_policy)

    def call(self, x):
        return self.c_proj(gelu(self.c_fc(x)))


class Block(Remat, Layer):
    """block: pre-norm attention and MLP, each added to the residual stream."""

    CONFIG = ("hparams",)

    def __init__(self, *, hparams, **kwargs):
        super().__init__(**kwargs)
        self.hparams = hparams = as_hparams(hparams)
        nx = hparams.n_embd
        dtype = self.dtype_policy
        self.ln_1 = Norm(nx, name="ln_1", dtype=dtype)
        self.attn = Attention(nx, hparams=hparams, name="attn", dtype=dtype)
        self.ln_2 = Norm(nx, name="ln_2", dtype=dtype)
        self.mlp = MLP(nx, nx * 4, name="mlp", dtype=dtype)

    def call(self, x, past=None, *, attn_mask):
        a, present = self.attn(self.ln_1(x), past, attn_mask=attn_mask)
        x = x + a
        m = self.mlp(self.ln_2(x))
        x = x + m
        return x, present

    def compute_output_shape(self, input_shape):
        return self.attn.compute_output_shape(input_shape)


def past_shape(*, hparams, batch_size=None, sequence=None):
    return [batch_size, hparams.n_layer, 2, hparams.n_head, sequence, hparams.n_embd // hparams.n_head]


def positions_for(tokens, past_length):
    batch_size, nsteps = shape_list(tokens)
    return tf.tile((past_length + tf.range(nsteps))[None], [batch_size, 1])


class GPT2(TokenIds, LoRAModel, Int8Model, Fit, TF32, Unwritten, Config, keras.Model):
    """model: embeddings, n_layer blocks, a final norm, logits from `wte` (or, untied,
    `out_head`); `model(X, past=None)` returns {'logits', 'present'} as the original's model().
    `initialize=False` leaves the variables unwritten (for a checkpoint to be loaded into),
    `remat=True` recomputes each block in the backward pass, `tf32=True` lets float32 products
    use TensorFloat-32 (docs/precision.md). `model.save("x.keras")` loads with Keras'."""

    CONFIG = ("hparams", "tie_embeddings", "tf32")

    def __init__(self, hparams=None, *, tie_embeddings=True, initialize=True, remat=False, tf32=False,
                 name="model", **kwargs):
        super().__init__(name=name, **kwargs)
        self.hparams = as_hparams(hparams or default_hparams()).validate()
        if self.hparams.n_vocab < 1:
            raise ValueError("hparams.n_vocab must be set (>= 1); read it from hparams.json")
        self.tie_embeddings = tie_embeddings
        self.h = [Block(hparams=self.hparams, remat=remat, name=f"h{layer}", dtype=self.dtype_policy)
                  for layer in range(self.hparams.n_layer)]
        self.ln_f = Norm(self.hparams.n_embd, name="ln_f", dtype=self.dtype_policy)
        self.allow_tf32(tf32)
        self.leave_unwritten(not initialize)
        self.build()

    def build(self, input_shape=None):
        hp = self.hparams
        self.wpe = self.add_weight(name="wpe", shape=[hp.n_ctx, hp.n_embd], initializer=self.normal(0.01))
        self.wte = self.add_weight(name="wte", shape=[hp.n_vocab, hp.n_embd], initializer=self.normal(0.02))
        for block in self.h:
            block.build((None, None, hp.n_embd))
        self.ln_f.build((None, None, hp.n_embd))
        self.out_head = None if self.tie_embeddings else self.add_weight(
            name="out_head", shape=[hp.n_vocab, hp.n_embd], initializer=self.normal(0.02))
        self.int8_logits_build()  # where the config names the output weight int8 (`model.quantize("int8")`)

    def call(self, X, past=None, *, return_hidden=False):
        """The original's model(); `return_hidden` adds 'hidden' [batch, n_layer, T, n_embd], the
        residual stream after each block. A row with a token id outside [0, n_vocab) or a position
        past n_ctx raises (eager, tf.function), or, under XLA, which cannot raise, comes out as NaN."""
        hp = self.hparams
        batch, sequence = shape_list(X)
        if past is not None:
            past = check_past(past, past_shape(hparams=hp, batch_size=batch if isinstance(batch, int) else None))
        past_length = 0 if past is None else shape_list(past)[-2]
        pasts = tf.unstack(past, axis=1) if past is not None else [None] * hp.n_layer
        X, positions, ok = check_inputs(X, positions_for(X, past_length), hp)
        h = tf.gather(self.wte, X) + tf.gather(self.wpe, positions)
        h = tf.where(ok[:, None, None], h, tf.constant(np.nan, h.dtype))
        # The offset read from X (times 0), so that the mask is computed at run time: XLA's bridge
        # copies a folded constant for each op reading it (124M's remat step: 0.8 GB more peak).
        offset = past_length + 0 * tf.cast(tf.reduce_min(X[:1, :1]), tf.int32)
        mask = attention_mask(sequence, past_length + sequence, dtype=h.dtype, offset=offset)

        presents, hidden = [], []
        for block, layer_past in zip(self.h, pasts):
            h, present = block(h, layer_past, attn_mask=mask)
            presents.append(present)
            hidden.append(h)
        hidden = {"hidden": tf.stack(hidden, axis=1)} if return_hidden else {}
        return {"present": tf.stack(presents, axis=1), "logits": self.lm_logits(h), **hidden}

    def as_compute(self, variable):
        """A model-level variable in the compute dtype (Keras autocasts only inside `__call__`)."""
        return tf.cast(variable, self.compute_dtype)

    def lm_logits(self, h, wte=None):
        """The final norm, then logits from `wte` (or `out_head`; or the `wte` given, the
        decoding engine's copy of it: `decoding.cache.held_logits`): [batch, T, n_vocab] float32."""
        hp = self.hparams
        batch, sequence, _ = shape_list(h)
        h = self.ln_f(h)

        # Language model loss.  Do tokens <n predict token n?
        h_flat = tf.reshape(h, [batch * sequence, hp.n_embd])
        if self.logits_int8 is not None:  # `model.quantize("int8")`: an int8 copy of wte (adapters/int8.py)
            return tf.reshape(self.int8_logits(h_flat), [batch, sequence, hp.n_vocab])
        wte = self.as_compute(self.output_weight()) if wte is None else wte
        logits = matmul(tf.cast(h_flat, wte.dtype), wte, transpose_b=True, tf32=self.tf32)
        logits = tf.cast(logits, h.dtype)  # in the compute dtype, as from a `wte` in it
        return tf.reshape(tf.cast(logits, tf.float32), [batch, sequence, hp.n_vocab])


for layer in (Norm, Conv1D, Attention, MLP, Block, GPT2):  # for keras.models.load_model, as "tfgpt2>GPT2"
    keras.saving.register_keras_serializable(package="tfgpt2")(layer)
