"""LoRA adapters (`GPT2.enable_lora`) on disk, and merged into OpenAI's layout.

An adapter checkpoint (a run folder's `lora-<step>.*`) is a TensorFlow checkpoint of the
adapters alone: `<layer>/lora_kernel_a` [nx, rank] and `<layer>/lora_kernel_b` [rank, nf] for
each adapted Conv1D (`model/h0/attn/c_attn/lora_kernel_a`, ...), and `lora/config`, a JSON
string: {"rank", "alpha", "targets", "base"} (`base`: the checkpoint the adapters were trained
on, for the record). The merged weights are OpenAI's variables, each adapted `w` replaced by
w + (alpha / rank) * A B, so that any tool that reads OpenAI's checkpoints reads them.
"""
import json
import os

import numpy as np
import tensorflow as tf

from ..products import matmul

CONFIG = "lora/config"


def lora_config(model, base=None):
    """{"rank", "alpha", "targets", "base"} of a model with LoRA enabled; None without."""
    return {**model.lora, "base": base} if model.lora else None


def adapter_tensors(model, base=None):
    """The adapters and `lora/config` (checkpoint name -> variable or string), to write with
    `checkpoint.save_tensors`."""
    tensors = {v.path: v for _, conv in model.conv1d_layers() if conv.lora_enabled
               for v in (conv.lora_kernel_a, conv.lora_kernel_b)}
    tensors[CONFIG] = tf.constant(json.dumps(lora_config(model, base)))
    return tensors


def merged_weights(model):
    """The model's variables in OpenAI's layout (name -> tensor): each adapted `w` as
    w + (alpha / rank) * A B, in float32 where `w` is; every other variable as it is."""
    merged = {}
    for _, conv in model.conv1d_layers():
        if conv.lora_enabled:
            a, b = (tf.cast(v, conv.w.dtype) for v in (conv.lora_kernel_a, conv.lora_kernel_b))
            merged[conv.w.path] = conv.w + (conv.lora_alpha / conv.lora_rank) * matmul(a, b)[None]
    lora = {id(v) for _, conv in model.conv1d_layers() if conv.lora_enabled
            for v in (conv.lora_kernel_a, conv.lora_kernel_b)}
    return {v.path: merged.get(v.path, v) for v in model.weights if id(v) not in lora}


def adapters_prefix(path):
    """The adapter checkpoint `path` names: a prefix (`run1/lora-100`), or a run folder, for
    the `lora-<step>` of its latest checkpoint `model-<step>`."""
    if os.path.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"{path}: no `checkpoint` file naming a model-<step> (not a run folder)")
        step = os.path.basename(latest).rsplit("-", 1)[-1]
        path = os.path.join(path, f"lora-{step}")
    if not os.path.isfile(path + ".index"):
        raise FileNotFoundError(f"{path}.index: no such file (LoRA adapters expected at {path!r})")
    return path


def read_config(prefix):
    """The `lora/config` of an adapter checkpoint."""
    reader = tf.train.load_checkpoint(prefix)
    if not reader.has_tensor(CONFIG):
        raise ValueError(f"{prefix}: holds no {CONFIG!r}: not a LoRA adapter checkpoint")
    return json.loads(reader.get_tensor(CONFIG))


def apply_adapters(model, path):
    """Enable LoRA on `model` as the adapter checkpoint at `path` (a prefix or a run folder)
    records, and load its adapters: base plus adapters, not merged. Returns the config."""
    prefix = adapters_prefix(path)
    config = read_config(prefix)
    model.enable_lora(config["rank"], config["targets"], lora_alpha=config["alpha"])
    reader = tf.train.load_checkpoint(prefix)
    stored = {name: tuple(shape) for name, shape in reader.get_variable_to_shape_map().items() if name != CONFIG}
    variables = [v for _, conv in model.conv1d_layers() if conv.lora_enabled
                 for v in (conv.lora_kernel_a, conv.lora_kernel_b)]
    expected = {v.path: tuple(v.shape) for v in variables}
    if stored != expected:
        wrong = sorted(set(stored.items()) ^ set(expected.items()))
        raise ValueError(f"{prefix}: its adapters do not fit this model (hparams {model.hparams.values()}): "
                         f"{len(stored)} tensors against {len(expected)} expected; first difference (name, shape): "
                         f"{wrong[:2]}")
    for variable in variables:
        variable.assign(np.asarray(reader.get_tensor(variable.path), variable.dtype))
    return config
