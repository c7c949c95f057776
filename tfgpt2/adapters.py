"""LoRA adapters and int8 quantization for `model.py`'s layers, as mixins its classes inherit
(`Conv1DAdapters` for Conv1D, `GPT2Adapters` for GPT2), so that the layers read as the
original's.

Both follow Keras's own: a Conv1D takes `enable_lora` as Keras's Dense does, and
`model.quantize("int8")` reaches it as it reaches a Dense (`quantize`, `quantized_build`,
`_int8_call`); GPT2 takes `enable_lora` as KerasHub's backbones do. Keras's layer API for
these is partly private (`_tracker`, `_int8_call`, `_flatten_layers`): it is used here only.
"""
import keras
import numpy as np
import tensorflow as tf

from .products import matmul

LORA_TARGETS = ("c_attn",)
"""`GPT2.enable_lora`'s default: each block's fused query, key and value projection (docs/finetuning.md, LoRA)."""


def _check_rank(rank, where=""):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"{where}the LoRA rank must be an integer >= 1, got {rank!r}")


class Conv1DAdapters:
    """Conv1D's LoRA adapters and int8 weights.

    `enable_lora`: `w` frozen, and (lora_alpha / rank) x A B added to the output
    (`lora_output`). `quantize("int8")`: `w` becomes int8 with a float32 `w_scale` [nf]
    (127 / each column's abs max), and each product quantizes its input rows likewise
    (`_int8_call`). The float weights keep the checkpoint's names."""

    # the variables a `.keras` file stores, in order, per quantization mode
    STORED = {None: ("w", "b"), "int8": ("w", "b", "w_scale")}
    lora_enabled = False

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
        _check_rank(rank, f"{self.name}: ")
        self._tracker.unlock()
        self.lora_kernel_a = self.add_weight(name="lora_kernel_a", shape=[self.nx, rank], initializer=a_initializer)
        self.lora_kernel_b = self.add_weight(name="lora_kernel_b", shape=[rank, self.nf], initializer=b_initializer)
        self._tracker.lock()
        self.w.trainable = False
        self.lora_enabled, self.lora_rank = True, int(rank)
        self.lora_alpha = float(rank if lora_alpha is None else lora_alpha)

    def lora_output(self, x):
        """The adapter's share of the output for x [rows, nx]: (lora_alpha / rank) x A B, x A
        first (never a weight-sized product)."""
        a, b = (tf.cast(v, x.dtype) for v in (self.lora_kernel_a, self.lora_kernel_b))
        return matmul(matmul(x, a, tf32=self.tf32), b, tf32=self.tf32) * (self.lora_alpha / self.lora_rank)

    def quantize(self, mode=None, type_check=True, config=None):
        if type_check and Conv1DAdapters not in type(self).__bases__:  # Conv1D itself, not a subclass
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
        y = tf.cast(keras.ops.matmul(x_int8, tf.reshape(self.w, [self.nx, self.nf])), self.compute_dtype)
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


class GPT2Adapters:
    """GPT2's LoRA adapters (`enable_lora`, recorded in `lora` and in the config) and the config
    of a quantized model (`with_quantized_dtype`)."""

    lora = None  # `enable_lora`'s arguments, once enabled

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
        _check_rank(rank)
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

    def with_quantized_dtype(self, config):
        """`config` with, where layers are quantized, the dtype as a `DTypePolicyMap` naming each
        one's policy by its path, so that loading builds them quantized (as KerasHub's backbones)."""
        quantized = {layer.path: layer.dtype_policy for layer in self._flatten_layers() if layer.quantization_mode}
        if quantized:
            policy = self.dtype_policy
            base = policy.default_policy if isinstance(policy, keras.dtype_policies.DTypePolicyMap) else policy
            config["dtype"] = keras.dtype_policies.serialize(keras.dtype_policies.DTypePolicyMap(base, quantized))
        return config
