"""int8 weights: `model.quantize("int8")` reaches a Conv1D as it reaches a Keras Dense
(`quantize`, `quantized_build`, and `_int8_call`, which Keras' `__call__` runs in place of
`call`), and a quantized GPT2's config names each layer's policy."""
import keras
import numpy as np
import tensorflow as tf


class Int8:
    """`quantize("int8")`: `w` becomes int8 with a float32 `w_scale` [nf] (127 / each column's
    abs max), and each product quantizes its input rows likewise (`_int8_call`). The float
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
        x_int8, x_scale = keras.quantizers.abs_max_quantize(tf.reshape(x, [-1, self.nx]), axis=-1)
        y = tf.cast(int8_matmul(x_int8, tf.reshape(self.w, [self.nx, self.nf])), self.compute_dtype)
        y = y / (tf.cast(x_scale, self.compute_dtype) * tf.cast(self.w_scale, self.compute_dtype))
        y = tf.reshape(y + self.b, tf.concat([tf.shape(x)[:-1], [self.nf]], 0))
        y.set_shape(x.shape[:-1].concatenate([self.nf]))  # the static shape, where known
        return y

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


def int8_matmul(x, w):
    """x @ w for int8 x [rows, nx] and w [nx, nf], into int32. A single row is multiplied as two
    (itself twice): XLA's CPU backend widens a one-row int8 product's operands to int32 (four
    times the weight's bytes, read at every step), and multiplies int8 as such from two rows on."""
    if x.shape[0] == 1:
        return keras.ops.matmul(tf.concat([x, x], 0), w)[:1]
    return keras.ops.matmul(x, w)


class Int8Model:
    """The config of a quantized model."""

    def get_config(self):
        return self.with_quantized_dtype(super().get_config())

    def with_quantized_dtype(self, config):
        """`config` with, where layers are quantized, the dtype as a `DTypePolicyMap` naming each
        one's policy by its path, so that loading builds them quantized (as KerasHub's backbones)."""
        quantized = {layer.path: layer.dtype_policy for layer in self._flatten_layers() if layer.quantization_mode}
        if quantized:
            policy = self.dtype_policy
            base = policy.default_policy if isinstance(policy, keras.dtype_policies.DTypePolicyMap) else policy
            config["dtype"] = keras.dtype_policies.serialize(keras.dtype_policies.DTypePolicyMap(base, quantized))
        return config
