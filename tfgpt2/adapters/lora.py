"""LoRA adapters: on Conv1D as Keras' `Dense.enable_lora`, on GPT2 as KerasHub's backbones'
`enable_lora` (recorded in `lora` and in the config)."""
import keras
import numpy as np
import tensorflow as tf

from ..products import matmul

LORA_TARGETS = ("c_attn",)
"""`GPT2.enable_lora`'s default: each block's fused query, key and value projection (docs/finetuning.md, LoRA)."""


def _check_rank(rank, where=""):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"{where}the LoRA rank must be an integer >= 1, got {rank!r}")


class LoRA:
    """Conv1D's adapters: `enable_lora` freezes `w`, and each call adds (lora_alpha / rank) x A B
    to the layer's output (`lora_output`)."""

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

    def __call__(self, x, *args, **kwargs):
        """The layer's output, plus its adapters' share where enabled."""
        y = super().__call__(x, *args, **kwargs)
        if not self.lora_enabled or isinstance(y, keras.KerasTensor):
            return y
        with tf.name_scope(self.name):
            lora = self.lora_output(tf.reshape(tf.cast(x, y.dtype), [-1, self.nx]))
            return y + tf.ensure_shape(tf.reshape(lora, tf.shape(y)), y.shape)


class LoRAModel:
    """GPT2's adapters: `enable_lora` on the Conv1D layers it names, recorded in `lora` and in
    the config (`from_config` enables them again)."""

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

    def get_config(self):
        return {**super().get_config(), **({"lora": self.lora} if self.lora else {})}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        lora = config.pop("lora", None)
        model = super().from_config(config, custom_objects)
        if lora:
            model.enable_lora(lora["rank"], lora["targets"], lora_alpha=lora["alpha"])
        return model
