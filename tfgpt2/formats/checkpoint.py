"""OpenAI's original checkpoints <-> the Keras variables of `GPT2`.

A model folder (`models_dir/model_name`) holds `checkpoint`, `hparams.json`,
`model.ckpt.index`, `model.ckpt.data-00000-of-00001` (and `model.ckpt.meta`, which is not
needed). Tensors are read a block of rows at a time (`bundle.py`) straight into the model's
variables, cast as they are read, so loading never holds a second copy of any weight.
"""
import glob
import os
import re
import warnings

import numpy as np
import tensorflow as tf

from ..hparams import load_hparams
from .variables import variable_shapes
from ..model import GPT2
from . import bundle
from .files import staging, write_text
from .folders import find_model_dir, save_hparams
from .lora import apply_adapters, merged_weights


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the hparams."""


def checkpoint_prefix(path):
    """The checkpoint prefix for a model folder (via its `checkpoint` file) or a prefix itself."""
    prefix = _named_prefix(path) if os.path.isdir(path) else path
    if not os.path.isfile(prefix + ".index"):
        raise FileNotFoundError(f"{prefix}.index: no such file (checkpoint prefix {prefix!r})")
    if not glob.glob(glob.escape(prefix) + ".data-*-of-*"):
        raise FileNotFoundError(f"{prefix}.data-00000-of-00001: no such file (checkpoint prefix {prefix!r})")
    return prefix


def _named_prefix(folder):
    """The prefix that `<folder>/checkpoint` names, relative to the folder unless absolute (what
    `tf.train.latest_checkpoint` reads, without the log line it prints when that is missing)."""
    state_file = os.path.join(folder, "checkpoint")
    if not os.path.isfile(state_file):
        raise FileNotFoundError(f"{state_file}: no such file; {folder!r} holds no TensorFlow checkpoint")
    with open(state_file, encoding="utf-8", errors="replace") as f:
        match = re.search(r'^\s*model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', f.read(), re.M)
    if match is None:
        raise CheckpointError(f"{state_file}: names no checkpoint (no model_checkpoint_path line)")
    name = re.sub(r"\\(.)", r"\1", match.group(1))
    prefix = os.path.join(folder, name)
    if not os.path.isfile(prefix + ".index"):
        raise CheckpointError(f"{state_file}: names checkpoint {name!r}, which does not exist in {folder!r} "
                              f"(no {prefix}.index)")
    return prefix


def open_reader(prefix):
    """`tf.train.load_checkpoint(prefix)`, its errors as CheckpointError naming the file."""
    try:
        return tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError) as e:
        raise CheckpointError(f"{prefix}.index: cannot read the checkpoint: {_message(e)}") from None


def _message(e):
    return getattr(e, "message", str(e)).strip().splitlines()[0]


def plan_restore(stored, hparams, tie_embeddings, prefix):
    """Map each model variable to the checkpoint tensor it is read from, checking names and
    shapes. Optimizer slots (`.../Adam`) and `global_step` that fine-tuning leaves are ignored."""
    expected = variable_shapes(hparams, tie_embeddings=tie_embeddings)
    source = {name: name for name in expected}
    if not tie_embeddings and "model/out_head" not in stored:
        source["model/out_head"] = "model/wte"  # an original (tied) checkpoint: the head starts as wte
    if tie_embeddings and "model/out_head" in stored:
        raise CheckpointError(f"{prefix}: has an untied output layer 'model/out_head'; "
                              "load it with tie_embeddings=False")
    missing = sorted(name for name in set(source.values()) if name not in stored)
    unexpected = sorted(name for name in stored
                        if name.startswith("model/") and name not in expected
                        and name.rsplit("/", 1)[0] not in expected and name != "model/out_head")
    wrong = [f"{name}: checkpoint {stored[src]}, hparams expect {expected[name]}"
             for name, src in source.items() if src in stored and list(stored[src]) != expected[name]]
    problems = []
    if missing:
        problems.append(f"missing variables: {', '.join(missing)}")
    if unexpected:
        problems.append(f"variables the hparams do not have: {', '.join(unexpected[:10])}"
                        + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    if wrong:
        problems.append("shape mismatch: " + "; ".join(wrong[:10]))
    if problems:
        raise CheckpointError(f"{prefix} does not fit hparams {hparams.values()}: " + " | ".join(problems))
    return source


def read_checkpoint_index(prefix):
    """`bundle.read_index(prefix)`, its errors as CheckpointError."""
    try:
        return bundle.read_index(prefix)
    except (OSError, bundle.BundleError) as e:
        raise CheckpointError(f"{prefix}.index: cannot read the checkpoint: {e}") from None


def stored_shapes(entries):
    return {name: [d.size for d in entry.shape.dim] for name, entry in entries.items()}


def _restore(model, prefix, header, entries, source):
    """Each variable from the checkpoint tensor `source` maps its name to, a block of rows at a
    time (`bundle.row_blocks`), each block cast to the variable's dtype as it is read: peak
    memory is the model plus one block, never a float32 copy of a bfloat16 model's `wte`."""
    for variable in model.weights:
        name = source[variable.path]
        # A variable mirrored by a tf.distribute strategy is written copy by copy.
        copies = getattr(variable.value, "values", (variable.value,))
        try:
            for indices, rows in bundle.row_blocks(prefix, header, entries[name]):
                if not np.isfinite(rows).all():
                    raise CheckpointError(f"{bundle.data_file(prefix, header, entries[name])}: tensor {name!r} "
                                          "holds NaN or inf values (from a training run that diverged?)")
                for copy in copies:
                    # in place, unlike `copy[a:b].assign`, which reads the variable first, so
                    # that TensorFlow copies the whole buffer before writing to it
                    tf.raw_ops.ResourceScatterNdUpdate(ref=copy.handle, indices=indices,
                                                       updates=tf.cast(rows, copy.dtype))
        except (OSError, bundle.BundleError) as e:
            raise CheckpointError(f"{bundle.data_file(prefix, header, entries[name])}: cannot read tensor "
                                  f"{name!r}: {e}") from None
        for copy in copies:
            # a scatter leaves the variable copy-on-read: each later read would copy it whole
            tf.raw_ops.DisableCopyOnRead(resource=copy.handle)
    return model


def load_model(model_dir, *, checkpoint=None, tie_embeddings=True, dtype=None, remat=False, models_dir="models",
               lora=None, tf32=False):
    """Build `GPT2` from `<model_dir>/hparams.json` and load the original checkpoint into it.

    `model_dir` is a folder, or a model name ("124M") for `<models_dir>/<name>`.
    `checkpoint` (a folder or prefix) defaults to `model_dir`. The checkpoint's names and
    shapes are checked against the hparams before any weight is allocated. `dtype`: a Keras
    dtype policy ("bfloat16", "mixed_float16", ...); each tensor is cast as it is read. "int8":
    loaded in float32, then `model.quantize("int8")` (the blocks' weights int8 with a scale per
    column, the logits' an int8 copy of wte with a scale per row, products on int8 inputs
    quantized per row; docs/precision.md).
    `remat`: as `GPT2`'s (fine-tuning with less memory). `lora`: LoRA adapters to apply, not
    merged (`formats.lora.apply_adapters`: a run folder or a `lora-<step>` prefix). `tf32`: as
    `GPT2`'s (TensorFloat-32 allowed in float32 products; docs/precision.md).
    """
    model_dir = find_model_dir(model_dir, models_dir)
    hparams = load_hparams(model_dir)
    prefix = checkpoint_prefix(checkpoint or model_dir)
    header, entries = read_checkpoint_index(prefix)
    source = plan_restore(stored_shapes(entries), hparams, tie_embeddings, prefix)
    quantize = dtype == "int8"
    model = GPT2(hparams, tie_embeddings=tie_embeddings, initialize=False, dtype="float32" if quantize else dtype,
                 remat=remat, tf32=tf32)
    _restore(model, prefix, header, entries, source)
    if lora and quantize:
        raise ValueError("LoRA adapters cannot be applied to an int8 model: merge them into a checkpoint "
                         "(a run's model-<step>) and load that with dtype int8")
    if lora:
        apply_adapters(model, lora)
    if quantize:
        with warnings.catch_warnings():  # Keras names each layer that has nothing to quantize (the norms)
            warnings.filterwarnings("ignore", message="Layer .* does not have a `quantize` method")
            model.quantize("int8")
    return model


def save_tensors(folder, name, tensors):
    """Write `tensors` (checkpoint name -> array or variable) as `<name>.index` and
    `<name>.data-00000-of-00001` in `folder` (`files.staging`: never a partial file under a
    final name)."""
    with staging(folder, last=f"{name}.index") as tmp:
        names = sorted(tensors)
        tf.raw_ops.SaveV2(prefix=os.path.join(tmp, name), tensor_names=names,
                          shape_and_slices=[""] * len(names),
                          tensors=[tf.convert_to_tensor(tensors[n]) for n in names])
    return os.path.join(folder, name)


def save_checkpoint(tensors, hparams, model_dir, *, name="model.ckpt"):
    """Write `tensors` (checkpoint name -> array or variable) in the original layout:
    `<name>.index`, `<name>.data-00000-of-00001`, `hparams.json`, then the `checkpoint` file
    that names them, each written whole under a temporary name."""
    save_tensors(model_dir, name, tensors)
    save_hparams(hparams, model_dir)
    write_text(os.path.join(model_dir, "checkpoint"),
                 f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n')
    return os.path.join(model_dir, name)


def save_model(model, model_dir):
    """Save `model` so that OpenAI's own code restores it (`tf.train.Saver` on `model_dir`)."""
    return save_checkpoint(float32_weights(model), model.hparams, model_dir)


def float32_weights(model):
    """The model's variables as a checkpoint holds them (name -> float32 tensor), whatever its
    dtype policy, LoRA adapters merged; refused for a quantized model (its int8 weights are no
    checkpoint's: it saves with `model.save("x.keras")`)."""
    quantized = [v.path for v in model.weights if v.dtype == "int8"]
    if quantized:
        raise ValueError(f"a quantized model cannot be saved as an OpenAI checkpoint ({quantized[0]} is int8); "
                         "save it with model.save('x.keras'), or save the float model before model.quantize")
    return {name: tf.cast(v, tf.float32) for name, v in merged_weights(model).items()}
