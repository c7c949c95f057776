"""OpenAI's `src/model.py` as Keras 3 layers, with the same names, math and variables.

Each layer's variables carry the checkpoint's names (`model/h0/attn/c_attn/w`, shape
[1, n_embd, 3*n_embd]), so loading and saving are a loop over `model.weights`.

`GPT2.call(X, past)` is the original's `model()`, and `window_loss` the forks' training loss.
Generation runs the same layers over a fixed-size key/value cache (`tfgpt2.decoding.cache`),
sharing every projection, the mask and the softmax; nothing here knows about it.

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

from .hparams import as_hparams, default_hparams
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


def gelu(x):
    """GELU in its tanh form, as GPT-2 was trained (not the erf form), with its gradient
    written out (`gelu_grad`): outside XLA autodiff's is a dozen operations over each
    [batch, sequence, 4 * n_embd] tensor."""
    @tf.custom_gradient
    def run(x):
        return 0.5 * x * (1 + tf.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * tf.pow(x, 3)))), lambda dy: gelu_grad(dy, x)
    return run(x)


@tf.function(jit_compile=True, reduce_retracing=True)
def gelu_grad(dy, x):
    """dy * gelu'(x), in float32, as one XLA program (gradients run in training, where the
    shapes stay the same, so it is compiled once)."""
    x32 = tf.cast(x, tf.float32)
    t = tf.tanh(np.sqrt(2 / np.pi) * (x32 + 0.044715 * x32 * x32 * x32))
    slope = 0.5 * (1 + t) + 0.5 * x32 * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x32 * x32)
    return tf.cast(tf.cast(dy, tf.float32) * slope, dy.dtype)


def serializable(cls):
    """Register a layer for `keras.models.load_model`, under the package name tfgpt2."""
    return keras.saving.register_keras_serializable(package="tfgpt2")(cls)


def normalize(x, epsilon):
    """(x - mean) * rsqrt(variance + epsilon) over the last axis, with its gradient written out.

    Autodiff's gradient is the same, but its cheap pieces let XLA fuse each block's norm
    gradients, recomputed, into every block below it (fusions of ~200 operands at 12 layers):
    this one is materialized once per norm (docs/performance.md, Training)."""
    @tf.custom_gradient
    def run(x):
        u = tf.reduce_mean(x, axis=-1, keepdims=True)
        r = tf.math.rsqrt(tf.reduce_mean(tf.square(x - u), axis=-1, keepdims=True) + epsilon)
        y = (x - u) * r

        def grad(dy):
            return r * (dy - tf.reduce_mean(dy, axis=-1, keepdims=True)
                        - y * tf.reduce_mean(dy * y, axis=-1, keepdims=True))
        return y, grad
    return run(x)


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
class Conv1D(keras.layers.Layer):
    """conv1d: a dense layer whose weight keeps the original's [1, nx, nf] shape.

    `model.quantize("int8")` reaches it as Keras's Dense: `w` becomes int8 with a float32
    `w_scale` [nf] (127 / each column's abs max), and each product quantizes its input rows
    likewise (`_int8_call`). The float weights keep the checkpoint's names."""

    # the variables a `.keras` file stores, in order, per quantization mode
    STORED = {None: ("w", "b"), "int8": ("w", "b", "w_scale")}

    def __init__(self, nx, nf, *, w_init_stdev=0.02, initialize=True, tf32=False, **kwargs):
        super().__init__(**kwargs)
        self.nx, self.nf, self.w_init_stdev, self.initialize = nx, nf, w_init_stdev, initialize
        self.tf32 = tf32  # `products.matmul`'s: TensorFloat-32 allowed
        self.lora_enabled = False

    def build(self, input_shape=None):
        if self.quantization_mode:
            self.quantized_build(input_shape, self.quantization_mode)
        else:
            self.w = self.add_weight(name="w", shape=[1, self.nx, self.nf],
                                     initializer=normal(self.w_init_stdev, self.initialize))
        self.b = self.add_weight(name="b", shape=[self.nf], initializer="zeros")

    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"):
        """Keras' `Dense.enable_lora`: `w` frozen, and (lora_alpha / rank) * x A B added to the
        output, A `lora_kernel_a` [nx, rank], B `lora_kernel_b` [rank, nf] (zeros: the layer
        starts as it was). lora_alpha defaults to rank, as Keras'."""
        if not self.built:
            raise ValueError(f"{self.name}: cannot enable LoRA on a layer that isn't built yet")
        if self.lora_enabled:
            raise ValueError(f"{self.name}: LoRA is already enabled; it can be enabled once per layer")
        if self.quantization_mode:
            raise ValueError(f"{self.name}: LoRA on a quantized layer is not supported; enable it on the float model")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"{self.name}: the LoRA rank must be an integer >= 1, got {rank!r}")
        self._tracker.unlock()
        self.lora_kernel_a = self.add_weight(name="lora_kernel_a", shape=[self.nx, rank], initializer=a_initializer)
        self.lora_kernel_b = self.add_weight(name="lora_kernel_b", shape=[rank, self.nf], initializer=b_initializer)
        self._tracker.lock()
        self.w.trainable = False
        self.lora_enabled, self.lora_rank = True, int(rank)
        self.lora_alpha = float(rank if lora_alpha is None else lora_alpha)

    def call(self, x):
        *start, nx = shape_list(x)
        x = tf.reshape(x, [-1, nx])
        y = matmul(x, tf.reshape(self.w, [-1, self.nf]), tf32=self.tf32) + self.b
        if self.lora_enabled:
            y += self.lora_output(x)
        return tf.reshape(y, start + [self.nf])

    def lora_output(self, x):
        """The adapter's share of the output for x [rows, nx]: (lora_alpha / rank) x A B, x A
        first (never a weight-sized product)."""
        a, b = (tf.cast(v, x.dtype) for v in (self.lora_kernel_a, self.lora_kernel_b))
        return matmul(matmul(x, a, tf32=self.tf32), b, tf32=self.tf32) * (self.lora_alpha / self.lora_rank)

    def quantize(self, mode=None, type_check=True, config=None):
        if type_check and type(self) is not Conv1D:
            raise self._not_implemented_error(self.quantize)
        if mode != "int8":
            raise self._quantization_mode_error(mode)
        if self.lora_enabled:
            raise ValueError(f"{self.name}: a layer with LoRA adapters cannot be quantized; merge them first "
                             "(save the run's merged model-<step> and load it)")
        w, scale = keras.quantizers.abs_max_quantize(self.w.numpy(), axis=1, to_numpy=True)
        del self.w
        self.quantized_build(None, mode)
        self.w.assign(w)
        self.w_scale.assign(np.reshape(scale, [self.nf]))
        self.dtype_policy = keras.dtype_policies.get(f"{mode}_from_{self.dtype_policy.name}")

    def quantized_build(self, input_shape, mode):
        if mode != "int8":
            raise self._quantization_mode_error(mode)
        self.w = self.add_weight(name="w", shape=[1, self.nx, self.nf], initializer="zeros", dtype="int8",
                                 trainable=False)
        self.w_scale = self.add_weight(name="w_scale", shape=[self.nf], initializer="ones", trainable=False)
        self._is_quantized = True

    def _int8_call(self, x):
        """x @ w in int8 (x's rows quantized as w's columns), rescaled to the compute dtype."""
        *start, nx = shape_list(x)
        x, x_scale = keras.quantizers.abs_max_quantize(tf.reshape(x, [-1, nx]), axis=-1)
        y = tf.cast(keras.ops.matmul(x, tf.reshape(self.w, [nx, self.nf])), self.compute_dtype)
        y = y / (tf.cast(x_scale, self.compute_dtype) * tf.cast(self.w_scale, self.compute_dtype))
        return tf.reshape(y + self.b, start + [self.nf])

    def stored(self):
        """The names of the variables a `.keras` file stores, in order: the weights of the
        quantization mode, then the LoRA adapters where enabled."""
        return self.STORED[self.quantization_mode] + ("lora_kernel_a", "lora_kernel_b") * self.lora_enabled

    def save_own_variables(self, store):
        for i, name in enumerate(self.stored()):
            store[str(i)] = getattr(self, name)

    def load_own_variables(self, store):
        names = self.stored()
        if len(store.keys()) != len(names):
            raise ValueError(f"layer {self.path}: the file holds {len(store.keys())} variables, "
                             f"this {self.quantization_mode or 'float'} layer {len(names)} ({', '.join(names)})")
        for i, name in enumerate(names):
            getattr(self, name).assign(store[str(i)])

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.nf)

    def get_config(self):
        return {**super().get_config(), "nx": self.nx, "nf": self.nf, "w_init_stdev": self.w_init_stdev,
                "tf32": self.tf32}


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


def attn_probs(w, mask, features):
    """softmax(mask_attn_weights(w * rsqrt(features))) in float32, returned in w's dtype, for
    w = q @ k^T [batch, heads, dst_sequence, src_sequence].

    The softmax is TensorFlow's kernel (the original's exp(w - max) / sum, in one operation),
    and the gradient is written out (`attn_probs_grad`): outside XLA autodiff's runs seven
    operations over each [batch, heads, T, T] tensor (docs/performance.md, Training)."""
    scale = tf.math.rsqrt(tf.cast(features, tf.float32))

    @tf.custom_gradient
    def run(w):
        y = tf.nn.softmax(mask_attn_weights(tf.cast(w, tf.float32), mask, scale))
        return tf.cast(y, w.dtype), lambda dy: attn_probs_grad(dy, y, heads_mask(mask, tf.float32) * scale)
    return run(w)


@tf.function(jit_compile=True, reduce_retracing=True)
def attn_probs_grad(dy, y, mask_scale):
    """attn_probs' gradient, y * (dy - sum(dy * y)) * mask * scale, as one XLA program (as
    `gelu_grad`)."""
    g = tf.cast(dy, tf.float32)
    return tf.cast(y * (g - tf.reduce_sum(g * y, axis=-1, keepdims=True)) * mask_scale, dy.dtype)


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


def recompute(block):
    """`block(h) -> (h, present)` that keeps only its input h for the backward pass and runs
    again there. Unlike `tf.recompute_grad`, the rerun reads the incoming gradient (h plus
    0 * a slice of it: XLA cannot fold a float times 0, which is NaN for inf), so that XLA can
    neither merge it with the forward pass (common subexpression elimination) nor schedule it
    early: the saving holds under XLA too. (An optimization barrier does the first, but XLA's
    CPU compiler drops barriers before it schedules.)"""
    @tf.custom_gradient
    def run(h):
        def grad(dh, dpresent, variables=()):
            h_again = h + 0 * dh[..., :1]
            with tf.GradientTape() as tape:
                tape.watch(h_again)
                again = block(h_again)
            grads = tape.gradient(again, [h_again, *variables], output_gradients=[dh, dpresent])
            return grads[0], grads[1:]
        return block(h), grad
    return run


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


def check_past(past, batch, hparams):
    """`past` as the original's [batch, n_layer, 2, n_head, T, head_dim]; a mismatch in a
    known dimension fails naming both shapes."""
    expected = past_shape(hparams=hparams, batch_size=batch if isinstance(batch, int) else None)
    shape = past.shape.as_list()
    known = [(e, s) for e, s in zip(expected, shape) if e is not None and s is not None]
    if len(shape) != len(expected) or any(e != s for e, s in known):
        names = "[batch, n_layer, 2, n_head, sequence, n_embd // n_head]"
        raise ValueError(f"past must be {names} = {['?' if e is None else e for e in expected]}, "
                         f"got shape {shape}")
    return past


def in_vocabulary(X, n_vocab):
    """Where the token ids X (a tensor, an array or an int) are in [0, n_vocab): the one rule
    for a valid id."""
    if tf.is_tensor(X):
        return tf.logical_and(X >= 0, X < tf.cast(n_vocab, X.dtype))
    return (np.asarray(X) >= 0) & (np.asarray(X) < n_vocab)


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


LORA_TARGETS = ("c_attn",)
"""`GPT2.enable_lora`'s default: each block's fused query, key and value projection (docs/finetuning.md, LoRA)."""


@serializable
class GPT2(keras.Model):
    """model: token and position embeddings, n_layer blocks, a final norm, and logits from the
    token embedding itself (weight tying), unless `tie_embeddings=False` gives the output
    layer its own matrix `model/out_head` [n_vocab, n_embd].

    `model(X, past=None)` returns {'logits': [batch, T, n_vocab],
    'present': [batch, n_layer, 2, n_head, T, n_embd // n_head]} as the original does.
    `initialize=False` leaves the variables unwritten, for a checkpoint to be loaded into.
    `dtype`: a Keras dtype policy ("float32", "bfloat16", "float16", "mixed_bfloat16",
    "mixed_float16"); `present` comes in its compute dtype, the logits always in float32.
    `remat=True` keeps only each block's input for the backward pass and recomputes the rest
    (`recompute`): less memory for fine-tuning, one more forward pass of time. `lora`: the
    arguments of `enable_lora` ({"rank", "alpha", "targets"}), as `get_config` records them.
    `tf32=True` lets float32 products use TensorFloat-32 where TensorFlow's settings allow it
    (NVIDIA GPUs from Ampere on: faster, less exact); by default they are full float32 on every
    device (`tfgpt2.products`, docs/precision.md).

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
        # compiled generation loops for this model (`tfgpt2.decoding.generator.generator_for`),
        # freed with it, as Keras keeps `predict_function` on the model
        self.generators = {}
        self.lora = None  # `enable_lora`'s arguments, once enabled
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
        """With quantized layers, the dtype as a `DTypePolicyMap` naming each one's policy by its
        path, so that loading builds them quantized (as KerasHub's backbones)."""
        config = {**super().get_config(), "hparams": self.hparams.values(), "tie_embeddings": self.tie_embeddings,
                  "tf32": self.tf32, **({"lora": self.lora} if self.lora else {})}
        quantized = {layer.path: layer.dtype_policy for layer in self._flatten_layers() if layer.quantization_mode}
        if quantized:
            policy = self.dtype_policy
            base = policy.default_policy if isinstance(policy, keras.dtype_policies.DTypePolicyMap) else policy
            config["dtype"] = keras.dtype_policies.serialize(keras.dtype_policies.DTypePolicyMap(base, quantized))
        return config

    @property
    def lora_targets(self):
        """The `enable_lora` target names; () without LoRA."""
        return tuple(self.lora["targets"]) if self.lora else ()

    def conv1d_layers(self):
        """[(name, Conv1D)] of every block, named as `enable_lora` takes them: "h0/attn/c_attn",
        "h0/attn/c_proj", "h0/mlp/c_fc", "h0/mlp/c_proj", ..."""
        return [(f"{block.name}/{part}/{conv.name}", conv) for block in self.h
                for part, convs in (("attn", (block.attn.c_attn, block.attn.c_proj)),
                                    ("mlp", (block.mlp.c_fc, block.mlp.c_proj)))
                for conv in convs]

    def enable_lora(self, rank, target_layer_names=None, *, lora_alpha=None, seed=None):
        """KerasHub's `Backbone.enable_lora`: every weight frozen, and a LoRA adapter of `rank`
        (`Conv1D.enable_lora`, scaled by lora_alpha / rank) added to each Conv1D that a name in
        `target_layer_names` ends with, in every block: "c_attn" (the fused query, key and value
        projection, the default, as PEFT's for GPT-2), "c_proj" (attention's and the MLP's),
        "c_fc", "attn/c_proj", "mlp/c_proj", or one block's, "h0/mlp/c_fc". Checked whole
        before anything changes; enabled once per model. `seed` draws the adapters' `a` (the
        i-th adapted layer's from seed + i), unseeded by default as Keras'."""
        targets = tuple(LORA_TARGETS if target_layer_names is None else
                        [target_layer_names] if isinstance(target_layer_names, str) else target_layer_names)
        if self.lora_targets:
            raise ValueError(f"LoRA is already enabled on this model (targets {list(self.lora_targets)}); "
                             "it can be enabled once")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"the LoRA rank must be an integer >= 1, got {rank!r}")
        layers = self.conv1d_layers()
        unknown = [t for t in targets if not any(("/" + name).endswith("/" + t.strip("/")) for name, _ in layers)]
        if unknown or not targets:
            raise ValueError(f"LoRA targets {unknown or list(targets)} name no Conv1D layer; the names are "
                             "c_attn, c_proj, c_fc, attn/c_proj, mlp/c_proj (or a block's, h0/attn/c_attn)")
        adapted = [conv for name, conv in layers if any(("/" + name).endswith("/" + t.strip("/")) for t in targets)]
        quantized = [name for name, conv in layers if conv.quantization_mode and conv in adapted]
        if quantized:
            raise ValueError(f"LoRA on a quantized layer is not supported ({quantized[0]} is quantized); "
                             "enable it on the float model")
        for variable in self.weights:
            variable.trainable = False
        for i, conv in enumerate(adapted):
            conv.enable_lora(rank, lora_alpha, keras.initializers.HeUniform(None if seed is None else seed + i))
        self.lora = {"rank": int(rank), "alpha": adapted[0].lora_alpha, "targets": list(targets)}
        self.generators.clear()  # compiled without the adapters

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
            past = check_past(past, batch, hp)
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
    """Softmax cross-entropy of each position, in float32 whatever the logits' dtype: the
    log-sum-exp of the logits less the label's logit, with the gradient written out (softmax
    less one-hot), each one XLA program (as `gelu`'s gradient; inlined in an XLA step).
    Outside XLA autodiff's gradient of the label's logit is a scatter into a zeroed
    [positions, n_vocab] tensor (docs/performance.md). NaN for a label outside [0, n_vocab),
    which `tf.gather` would clamp under XLA."""
    labels = tf.cast(labels, tf.int32)
    ok = tf.logical_and(labels >= 0, labels < tf.shape(logits)[-1])
    labels = tf.where(ok, labels, 0)

    @tf.custom_gradient
    def run(logits):
        lse, losses = log_sum_exp_less_label(logits, labels)
        return losses, lambda dy: token_losses_grad(dy, logits, lse, labels)
    return tf.where(ok, run(logits), np.nan)


@tf.function(jit_compile=True, reduce_retracing=True)
def log_sum_exp_less_label(logits, labels):
    """(log-sum-exp of the logits, that less the label's logit) per position, in float32."""
    x = tf.cast(logits, tf.float32)
    lse = tf.reduce_logsumexp(x, axis=-1)
    return lse, lse - tf.gather(x, labels, batch_dims=len(labels.shape))


@tf.function(jit_compile=True, reduce_retracing=True)
def token_losses_grad(dy, logits, lse, labels):
    """dy * (softmax(logits) - one_hot(labels)), in the logits' dtype."""
    probs = tf.exp(tf.cast(logits, tf.float32) - lse[..., None])
    return tf.cast((probs - tf.one_hot(labels, tf.shape(logits)[-1], dtype=tf.float32)) * dy[..., None], logits.dtype)


def lm_loss(labels, logits):
    """The forks' loss: the mean cross-entropy of each position's logits against the next token
    (`labels` = tokens[:, 1:] for logits of tokens[:, :-1]). A plain Keras loss for `fit`."""
    return tf.reduce_mean(token_losses(labels, logits))


def window_loss(model, tokens):
    """The loss of windows [batch, length]: the model reads length - 1 tokens and predicts the
    next of each (the forks read all `length` and drop the last position's logits: the same)."""
    return lm_loss(tokens[:, 1:], model(tokens[:, :-1])["logits"])
