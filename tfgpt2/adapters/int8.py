"""int8 weights: `model.quantize("int8")` reaches a Conv1D as it reaches a Keras Dense
(`quantize`, `quantized_build`, and `_int8_call`, which Keras' `__call__` runs in place of
`call`), and GPT2's output layer (`Int8Model`: the logits read an int8 copy of `wte`); a
quantized GPT2's config names each layer's policy, and the output weight's."""
import keras
import numpy as np
import tensorflow as tf


class Int8:
    """`quantize("int8")`: `w` becomes int8 [nf, nx], transposed (each output's nx weights in
    a row, which XLA's CPU backend multiplies at a decoding step's row 1.6 times as fast as
    [nx, nf]), with a float32 `w_scale` [nf] (127 / each output's abs max), and each product
    quantizes its input rows likewise (`_int8_call`). The float
    weights keep the checkpoint's names. A `.keras` file stores the mode's weights, then the
    LoRA adapters where enabled (`stored`)."""

    # the variables a `.keras` file stores, in order, per quantization mode
    STORED = {None: ("w", "b"), "int8": ("w", "b", "w_scale")}

    def quantize(self, mode=None, type_check=True, config=None):
        if type_check and Int8 not in type(self).__bases__:  # Conv1D itself, not a subclass
            raise self._not_implemented_error(self.quantize)
        if mode != "int8":
            raise self._quantization_mode_error(mode)
        if self.lora_enabled:
            raise ValueError(f"{self.name}: a layer with LoRA adapters cannot be quantized; merge them first "
                             "(save the run's merged model-<step> and load it)")
        w, scale = keras.quantizers.abs_max_quantize(self.w.numpy(), axis=1, to_numpy=True)
        # Keras' `del self.w` runs a full gc.collect() (for other backends' device buffers): one
        # per layer, seconds each in a process holding much; TensorFlow frees the variable as
        # its last reference goes
        self._untrack_variable(self.w)
        super(keras.layers.Layer, self).__delattr__("w")
        self.quantized_build(None, mode)
        self.w.assign(np.transpose(w[0]))
        self.w_scale.assign(np.reshape(scale, [self.nf]))
        self.dtype_policy = keras.dtype_policies.get(f"{mode}_from_{self.dtype_policy.name}")

    def quantized_build(self, input_shape, mode):
        if mode != "int8":
            raise self._quantization_mode_error(mode)
        self.w = self.add_weight(name="w", shape=[self.nf, self.nx], initializer="zeros", dtype="int8",
                                 trainable=False)
        self.w_scale = self.add_weight(name="w_scale", shape=[self.nf], initializer="ones", trainable=False)
        self._is_quantized = True

    def _int8_call(self, x):
        """x @ w in int8 (`int8_product`), plus b."""
        y = self.int8_product(tf.reshape(x, [-1, self.nx]))
        y = tf.reshape(y + self.b, tf.concat([tf.shape(x)[:-1], [self.nf]], 0))
        y.set_shape(x.shape[:-1].concatenate([self.nf]))  # the static shape, where known
        return y

    def int8_product(self, x, product=None):
        """x [rows, nx] @ w in int8 (x's rows quantized as w's columns), rescaled to the compute
        dtype: the int32 product of x's int8 rows and w by `product(x_int8)` (the decoding
        engine's row kernels), or `int8_matmul`."""
        x_int8, x_scale = keras.quantizers.abs_max_quantize(x, axis=-1)
        y = product(x_int8) if product else int8_matmul(x_int8, self.w, transpose_b=True)
        return rescaled(y, x_scale, self.w_scale, self.compute_dtype)

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
            getattr(self, name).assign(self.stored_value(name, store[str(i)]))

    def stored_value(self, name, value):
        """A file's value for variable `name`: an int8 `w` as [1, nx, nf] (the layout of files
        written before int8 weights were held as [nf, nx]) transposed; another shape refused."""
        variable = getattr(self, name)
        if name == "w" and self.quantization_mode == "int8" and tuple(value.shape) == (1, self.nx, self.nf):
            return np.transpose(np.asarray(value)[0])
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"layer {self.path}: the file's {name} is {list(value.shape)}, "
                             f"this layer's is {list(variable.shape)}")
        return value


def int8_matmul(x, w, transpose_b=False):
    """x @ w (w^T where `transpose_b`) for int8 x [rows, nx] and w [nx, nf] ([nf, nx]), into
    int32. A single row is multiplied as two (itself twice): XLA's CPU backend widens a one-row
    int8 product's operands to int32 (four times the weight's bytes, read at every step), and
    multiplies int8 as such from two rows on."""
    if x.shape[0] == 1:
        return int8_matmul(tf.concat([x, x], 0), w, transpose_b=transpose_b)[:1]
    return tf.linalg.matmul(x, w, transpose_b=transpose_b, output_type=tf.int32)


def rescaled(y, x_scale, w_scale, dtype):
    """An int8 product y [rows, nf] back to `dtype`: over its rows' scales x_scale [rows, 1]
    and its weight's w_scale [nf] (each 127 / abs max)."""
    return tf.cast(y, dtype) / (tf.cast(x_scale, dtype) * tf.cast(w_scale, dtype))


class Int8Model:
    """A quantized model: its output layer in int8 (`quantize`: the output weight, `wte` or
    `out_head` [n_vocab, n_embd], copied as int8 rows `<name>_int8` with a scale per row
    `<name>_scale`, 127 / the row's abs max; the logits product reads that copy with h's rows
    quantized as a Conv1D's input, `int8_logits`; the lookup still reads the float `wte`), and
    its config (`get_config`)."""

    logits_int8 = logits_scale = None  # the int8 copy of the output weight, and its scales

    def quantize(self, mode=None, **kwargs):
        """Keras' `Model.quantize` (every Conv1D), then the output weight in int8."""
        super().quantize(mode, **kwargs)
        w, scale = keras.quantizers.abs_max_quantize(self.output_weight().numpy(), axis=1, to_numpy=True)
        self.int8_logits_build(force=True)
        self.logits_int8.assign(w)
        self.logits_scale.assign(np.reshape(scale, [-1]))

    def output_weight(self):
        return self.wte if self.tie_embeddings else self.out_head

    def int8_logits_build(self, *, force=False):
        """The int8 copy of the output weight and its scales (zeros), where `force`d or the
        config names the output weight int8 (`with_quantized_dtype`): called by `build`."""
        w = self.output_weight()
        policy = self.dtype_policy
        if not force and not (isinstance(policy, keras.dtype_policies.DTypePolicyMap) and w.path in policy):
            return
        self.logits_int8 = self.add_weight(name=f"{w.name}_int8", shape=w.shape, initializer="zeros", dtype="int8",
                                           trainable=False)
        self.logits_scale = self.add_weight(name=f"{w.name}_scale", shape=w.shape[:1], initializer="ones",
                                            trainable=False)

    def int8_logits(self, h, product=None):
        """h [rows, n_embd] @ the output weight^T [n_embd, n_vocab] in int8: float32 logits. The
        int32 product of h's int8 rows and the int8 copy by `product(h_int8)`, or `int8_matmul`."""
        h_int8, h_scale = keras.quantizers.abs_max_quantize(h, axis=-1)
        y = product(h_int8) if product else int8_matmul(h_int8, self.logits_int8, transpose_b=True)
        return rescaled(y, h_scale, self.logits_scale, tf.float32)

    def get_config(self):
        return self.with_quantized_dtype(super().get_config())

    def with_quantized_dtype(self, config):
        """`config` with, where layers are quantized, the dtype as a `DTypePolicyMap` naming each
        one's policy by its path, so that loading builds them quantized (as KerasHub's backbones),
        and the output weight's path where its copy is int8."""
        quantized = {layer.path: layer.dtype_policy for layer in self._flatten_layers() if layer.quantization_mode}
        policy = self.dtype_policy
        base = policy.default_policy if isinstance(policy, keras.dtype_policies.DTypePolicyMap) else policy
        if self.logits_int8 is not None:
            quantized[self.output_weight().path] = keras.dtype_policies.get(f"int8_from_{base.name}")
        if quantized:
            config["dtype"] = keras.dtype_policies.serialize(keras.dtype_policies.DTypePolicyMap(base, quantized))
        return config
