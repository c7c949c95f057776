"""GPT-2 weights between OpenAI's layout, Hugging Face's and KerasHub's.

- `openai`: `hparams.json`, `checkpoint`, `model.ckpt.*`, `encoder.json`, `vocab.bpe`.
- `hf`: `config.json`, `model.safetensors` (or shards with `model.safetensors.index.json`),
  `vocab.json`, `merges.txt`, as `transformers.GPT2LMHeadModel.save_pretrained` writes them.
  Safetensors only: a `pytorch_model.bin` is a pickle, and is never read.
- `kerashub`: `config.json`, `model.weights.h5`, `tokenizer.json`, `preprocessor.json`,
  `metadata.json`, `assets/tokenizer/`, as `keras_hub.models.GPT2CausalLM.save_to_preset`
  writes them (KerasHub need not be installed).

Every layout is read into the checkpoint's names and shapes (`model/h0/attn/c_attn/w`,
[1, n_embd, 3*n_embd]) as float32 arrays, checked against its config, and written from them.
A folder is written under temporary names and its files renamed into place when all are
complete, its config last.

    tfgpt2 convert --from hf --to openai path/to/gpt2-hf models/gpt2-hf
"""
import json
import os
import shutil
import time

import numpy as np

from ..encoder import ASSETS_DIR, EOT, EOT_TOKEN, VOCAB_FILES, vocabulary_files
from ..hparams import HParams, load_hparams, read_json_object
from .variables import variable_shapes
from .files import staging

FORMATS = ("openai", "hf", "kerashub")
# Each layout's names for the vocabulary (encoder.json) and merges (vocab.bpe) files.
LAYOUT_VOCAB_FILES = {"openai": VOCAB_FILES, "hf": ("vocab.json", "merges.txt"),
               "kerashub": ("assets/tokenizer/vocabulary.json", "assets/tokenizer/merges.txt")}
# The file whose presence marks a complete folder: renamed into place last.
LAST = {"openai": "checkpoint", "hf": "config.json", "kerashub": "config.json"}
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # HF's causal mask buffers, not weights


class ConversionError(ValueError):
    """A folder that is not the GPT-2 its format says, or whose tensors disagree with its config."""


def read(folder, fmt):
    """(hparams, {checkpoint name: float32 array}) from a folder in layout `fmt`; the dict has
    `model/out_head` where the output layer is not tied to `wte`."""
    _check_format(fmt)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such folder")
    return {"openai": read_openai, "hf": read_hf, "kerashub": read_kerashub}[fmt](folder)


def write(hparams, tensors, folder, fmt, *, vocab=None):
    """Write `tensors` (as `read` returns them) as a folder in layout `fmt`, with the
    vocabulary files `vocab` ((encoder.json, vocab.bpe) paths; the shipped copy if None and
    n_vocab is GPT-2's)."""
    _check_format(fmt)
    check_tensors(hparams, tensors)
    if vocab is None and hparams.n_vocab == 50257:
        vocab = [os.path.join(ASSETS_DIR, name) for name in VOCAB_FILES]
    with staging(folder, last=LAST[fmt]) as tmp:
        {"openai": write_openai, "hf": write_hf, "kerashub": write_kerashub}[fmt](hparams, tensors, tmp)
        for source, name in zip(vocab or (), LAYOUT_VOCAB_FILES[fmt]):
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            shutil.copyfile(source, os.path.join(tmp, name))
    return folder


def convert(src, dst, *, src_format, dst_format):
    """Read `src` in one layout and write it to `dst` in another, vocabulary included."""
    hparams, tensors = read(src, src_format)
    return write(hparams, tensors, dst, dst_format, vocab=vocabulary_files(src, LAYOUT_VOCAB_FILES[src_format]))


def load(folder, fmt):
    """A `GPT2` from a folder in layout `fmt` (untied where the folder has its own output layer)."""
    from ..model import GPT2
    hparams, tensors = read(folder, fmt)
    model = GPT2(hparams, tie_embeddings="model/out_head" not in tensors, initialize=False)
    for variable in model.weights:
        variable.assign(tensors[variable.path])
    return model


def save(model, folder, fmt):
    """Write a `GPT2` as a folder in layout `fmt` (with the shipped vocabulary): float32, LoRA
    adapters merged, as `save_model`."""
    from .checkpoint import float32_weights  # TensorFlow: imported only when saving a model
    return write(model.hparams, {name: v.numpy() for name, v in float32_weights(model).items()}, folder, fmt)


def check_tensors(hparams, tensors):
    """Names and shapes of `tensors` against what `GPT2(hparams)` owns."""
    expected = variable_shapes(hparams, tie_embeddings="model/out_head" not in tensors)
    problems = [f"{name} is missing" for name in expected if name not in tensors]
    problems += [f"{name} is {list(np.shape(tensors[name]))}, hparams imply {shape}"
                 for name, shape in expected.items() if name in tensors and list(np.shape(tensors[name])) != shape]
    problems += [f"{name} is not a GPT-2 variable" for name in tensors if name not in expected]
    if problems:
        raise ConversionError(f"tensors do not fit hparams {hparams.values()}: {_some(problems, '; ')}")


def _some(items, sep=", ", n=8):
    """The first n items joined, and how many more there are."""
    return sep.join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _check_format(fmt):
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {list(FORMATS)}")


def _read_json(folder, name):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    return read_json_object(path, ConversionError)


def _write_json(value, path):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def _hparams(values, path):
    try:
        return HParams(**values).validate()
    except ValueError as e:
        raise ConversionError(f"{path}: {e}") from None


def _config_value(config, key, path):
    if key not in config:
        raise ConversionError(f"{path}: no {key!r}")
    return config[key]


def _float32(value, where):
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.floating) and value.dtype.name != "bfloat16":
        raise ConversionError(f"{where}: dtype {value.dtype}, expected a floating-point tensor")
    return value.astype(np.float32)


# OpenAI's layout.

def read_openai(folder):
    from .checkpoint import checkpoint_prefix, open_reader, plan_restore  # TensorFlow: only for this layout
    hparams = load_hparams(folder)
    prefix = checkpoint_prefix(folder)
    reader = open_reader(prefix)
    stored = reader.get_variable_to_shape_map()
    source = plan_restore(stored, hparams, "model/out_head" not in stored, prefix)
    return hparams, {name: _float32(reader.get_tensor(src), f"{prefix}: {src}") for name, src in source.items()}


def write_openai(hparams, tensors, folder):
    from .checkpoint import save_checkpoint
    save_checkpoint(tensors, hparams, folder)


# Hugging Face transformers: GPT2LMHeadModel.

def hf_name(name):
    """The HF name of a checkpoint variable: model/h0/attn/c_attn/w -> h.0.attn.c_attn.weight
    (model/out_head -> lm_head.weight)."""
    if name == "model/out_head":
        return "lm_head.weight"
    *path, last = name.split("/")[1:]
    if not path:  # wte, wpe
        return f"{last}.weight"
    if path[0][0] == "h" and path[0][1:].isdigit():
        path[0] = f"h.{path[0][1:]}"
    return ".".join(path + ["bias" if last == "b" else "weight"])


def hf_shape(shape):
    """HF keeps a Conv1D weight as [nx, nf], without the checkpoint's leading 1."""
    return shape[1:] if len(shape) == 3 else shape


def read_hf(folder):
    config_path = os.path.join(folder, "config.json")
    config = _read_json(folder, "config.json")
    hparams, tie = hf_hparams(config, config_path)
    shapes = variable_shapes(hparams, tie_embeddings=tie)
    files = _safetensors_files(folder)
    stored = {}  # HF name without 'transformer.' -> (file handle, full key)
    for key, handle in files.items():
        name = key.removeprefix("transformer.")
        if not name.endswith(HF_BUFFERS) and not (tie and name == "lm_head.weight"):
            stored[name] = handle, key
    wanted = {hf_name(name): name for name in shapes}
    where = os.path.join(folder, "model.safetensors")
    problems = [f"missing tensor {name}" for name in wanted if name not in stored]
    found = {name: stored[name][0].get_slice(stored[name][1]).get_shape() for name in wanted if name in stored}
    problems += [f"{name} is {shape}, config.json implies {hf_shape(shapes[wanted[name]])}"
                 for name, shape in found.items() if shape != hf_shape(shapes[wanted[name]])]
    extra = sorted(name for name in stored if name not in wanted)
    if extra:
        problems.append(f"tensors config.json's GPT-2 has no place for: {_some(extra)}")
    if problems:
        raise ConversionError(f"{where} does not fit {config_path} ({hparams.values()}, "
                              f"tie_word_embeddings={tie}): {_some(problems, '; ')}")
    tensors = {}
    for name, ours in wanted.items():
        handle, key = stored[name]
        tensors[ours] = _float32(handle.get_tensor(key), f"{where}: {key}").reshape(shapes[ours])
    return hparams, tensors


def hf_hparams(config, path):
    """(hparams, tie_word_embeddings) of an HF GPT-2 config; anything else is an error."""
    if config.get("model_type") != "gpt2":
        raise ConversionError(f"{path}: model_type {config.get('model_type')!r} is not GPT-2 ('gpt2')")
    architectures = config.get("architectures") or ["GPT2LMHeadModel"]
    unsupported = [a for a in architectures if a not in ("GPT2LMHeadModel", "GPT2Model")]
    if unsupported:
        raise ConversionError(f"{path}: architecture {unsupported[0]!r} is not supported "
                              "(GPT2LMHeadModel or GPT2Model)")
    n_embd = _config_value(config, "n_embd", path)
    differences = {  # settings HF allows that GPT-2 (and tfgpt2) does not have
        "activation_function": (config.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
        "layer_norm_epsilon": (config.get("layer_norm_epsilon", 1e-5), (1e-5,)),
        "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
    }
    for key, (value, allowed) in differences.items():
        if value not in allowed:
            raise ConversionError(f"{path}: {key}={value!r} is not GPT-2's ({' or '.join(map(repr, allowed))})")
    n_ctx = config.get("n_positions", config.get("n_ctx"))
    if n_ctx is None:
        raise ConversionError(f"{path}: no 'n_positions'")
    hparams = _hparams(dict(n_vocab=_config_value(config, "vocab_size", path), n_ctx=n_ctx, n_embd=n_embd,
                            n_head=_config_value(config, "n_head", path),
                            n_layer=_config_value(config, "n_layer", path)), path)
    return hparams, config.get("tie_word_embeddings", True)


def _safetensors_files(folder):
    """Tensor key -> the open safetensors file holding it (one file, or the shards of an index)."""
    from safetensors import safe_open
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _config_value(_read_json(folder, "model.safetensors.index.json"), "weight_map", index)
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        weight_map = None
    else:
        pickled = " (pytorch_model.bin is a pickle, which is never read: convert it to safetensors)" \
            if os.path.isfile(os.path.join(folder, "pytorch_model.bin")) else ""
        raise FileNotFoundError(f"{os.path.join(folder, 'model.safetensors')}: no such file{pickled}")
    handles, files = {}, {}
    for filename in sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]:
        path = os.path.join(folder, filename)
        try:
            handles[filename] = safe_open(path, framework="np")
        except Exception as e:  # safetensors raises its own error types
            raise ConversionError(f"{path}: not a readable safetensors file ({e})") from None
    for filename, handle in handles.items():
        files.update({key: handle for key in handle.keys()
                      if weight_map is None or weight_map.get(key) == filename})
    return files


def write_hf(hparams, tensors, folder):
    from safetensors.numpy import save_file
    tie = "model/out_head" not in tensors
    arrays = {("" if name == "model/out_head" else "transformer.") + hf_name(name):
              np.ascontiguousarray(np.reshape(value, hf_shape(list(np.shape(value)))), dtype=np.float32)
              for name, value in tensors.items()}
    save_file(arrays, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(folder, "model.safetensors"), 0o644)  # safetensors writes it as 0600
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "vocab_size": hparams.n_vocab, "n_positions": hparams.n_ctx, "n_ctx": hparams.n_ctx,
              "n_embd": hparams.n_embd, "n_head": hparams.n_head, "n_layer": hparams.n_layer,
              "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02,
              "tie_word_embeddings": tie, "torch_dtype": "float32"}
    if hparams.n_vocab == 50257:
        config.update(bos_token_id=EOT_TOKEN, eos_token_id=EOT_TOKEN)
    _write_json(config, os.path.join(folder, "config.json"))


# KerasHub: GPT2Backbone in a preset folder.

def kerashub_layout(hparams):
    """[(h5 dataset, checkpoint name, KerasHub shape, (part, parts) or None)] for every weight
    of KerasHub's GPT2Backbone: c_attn is split along its last axis into query, key and value
    (parts 0, 1, 2 of 3), kept as [n_embd, n_head, head_dim]."""
    e, heads = hparams.n_embd, hparams.n_head
    d = e // heads
    rows = [("layers/reversible_embedding/vars/0", "model/wte", [hparams.n_vocab, e], None),
            ("layers/position_embedding/vars/0", "model/wpe", [hparams.n_ctx, e], None),
            ("layers/layer_normalization/vars/0", "model/ln_f/g", [e], None),
            ("layers/layer_normalization/vars/1", "model/ln_f/b", [e], None)]
    for i in range(hparams.n_layer):
        layer, h = "layers/transformer_decoder" + (f"_{i}" if i else ""), f"model/h{i}"
        attention = f"{layer}/_self_attention_layer"
        for norm, ln in (("_self_attention_layer_norm", "ln_1"), ("_feedforward_layer_norm", "ln_2")):
            rows += [(f"{layer}/{norm}/vars/0", f"{h}/{ln}/g", [e], None),
                     (f"{layer}/{norm}/vars/1", f"{h}/{ln}/b", [e], None)]
        for part, dense in enumerate(("query_dense", "key_dense", "value_dense")):
            rows += [(f"{attention}/{dense}/vars/0", f"{h}/attn/c_attn/w", [e, heads, d], (part, 3)),
                     (f"{attention}/{dense}/vars/1", f"{h}/attn/c_attn/b", [heads, d], (part, 3))]
        rows += [(f"{attention}/output_dense/vars/0", f"{h}/attn/c_proj/w", [heads, d, e], None),
                 (f"{attention}/output_dense/vars/1", f"{h}/attn/c_proj/b", [e], None),
                 (f"{layer}/_feedforward_intermediate_dense/vars/0", f"{h}/mlp/c_fc/w", [e, 4 * e], None),
                 (f"{layer}/_feedforward_intermediate_dense/vars/1", f"{h}/mlp/c_fc/b", [4 * e], None),
                 (f"{layer}/_feedforward_output_dense/vars/0", f"{h}/mlp/c_proj/w", [4 * e, e], None),
                 (f"{layer}/_feedforward_output_dense/vars/1", f"{h}/mlp/c_proj/b", [e], None)]
    return rows


def kerashub_backbone_config(hparams):
    """config.json of a KerasHub GPT2Backbone (dropout 0.1, as KerasHub's GPT-2 presets)."""
    return {"module": "keras_hub.src.models.gpt2.gpt2_backbone", "class_name": "GPT2Backbone",
            "config": {"name": "gpt2_backbone", "trainable": True, "dtype": _keras_dtype("float32"),
                       "vocabulary_size": hparams.n_vocab, "num_layers": hparams.n_layer,
                       "num_heads": hparams.n_head, "hidden_dim": hparams.n_embd,
                       "intermediate_dim": 4 * hparams.n_embd, "dropout": 0.1,
                       "max_sequence_length": hparams.n_ctx},
            "registered_name": "keras_hub>GPT2Backbone"}


def _keras_dtype(name):
    return {"module": "keras", "class_name": "DTypePolicy", "config": {"name": name}, "registered_name": None}


def _kerashub_tokenizer_config():
    return {"module": "keras_hub.src.models.gpt2.gpt2_tokenizer", "class_name": "GPT2Tokenizer",
            "config": {"name": "gpt2_tokenizer", "trainable": True, "dtype": _keras_dtype("int32"),
                       "config_file": "tokenizer.json", "sequence_length": None, "add_prefix_space": False,
                       "unsplittable_tokens": [EOT]},
            "registered_name": "keras_hub>GPT2Tokenizer"}


def read_kerashub(folder):
    import h5py
    config_path = os.path.join(folder, "config.json")
    config = _read_json(folder, "config.json")
    name = config.get("registered_name") or config.get("class_name")
    if name not in ("keras_hub>GPT2Backbone", "GPT2Backbone"):
        raise ConversionError(f"{config_path}: {name!r} is not KerasHub's GPT2Backbone"
                              + ("" if name else " (a Hugging Face folder? use --from hf)"))
    c = _config_value(config, "config", config_path)
    hparams = _hparams(dict(n_vocab=_config_value(c, "vocabulary_size", config_path),
                            n_ctx=_config_value(c, "max_sequence_length", config_path),
                            n_embd=_config_value(c, "hidden_dim", config_path),
                            n_head=_config_value(c, "num_heads", config_path),
                            n_layer=_config_value(c, "num_layers", config_path)), config_path)
    if c.get("intermediate_dim") != 4 * hparams.n_embd:
        raise ConversionError(f"{config_path}: intermediate_dim {c.get('intermediate_dim')} is not "
                              f"GPT-2's 4 * hidden_dim = {4 * hparams.n_embd}")
    path = os.path.join(folder, "model.weights.h5")
    if not os.path.isfile(path):
        sharded = " (sharded presets are not supported)" if os.path.isfile(
            os.path.join(folder, "model.weights.json")) else ""
        raise FileNotFoundError(f"{path}: no such file{sharded}")
    layout = kerashub_layout(hparams)
    shapes = variable_shapes(hparams)
    parts = {}
    with h5py.File(path, "r") as f:
        stored = {}
        f.visititems(lambda key, item: stored.update({key: item.shape}) if isinstance(item, h5py.Dataset) else None)
        problems = [f"missing {key}" for key, *_ in layout if key not in stored]
        problems += [f"{key} is {list(stored[key])}, config.json implies {shape}"
                     for key, _, shape, _ in layout if key in stored and list(stored[key]) != shape]
        extra = sorted(set(stored) - {key for key, *_ in layout})
        if extra:
            problems.append(f"weights config.json's GPT-2 has no place for: {_some(extra)}")
        if problems:
            raise ConversionError(f"{path} does not fit {config_path} ({hparams.values()}): {_some(problems, '; ')}")
        for key, name, _, part in layout:
            value = _float32(_h5_value(f[key]), f"{path}: {key}")
            shape = hf_shape(shapes[name])
            parts.setdefault(name, []).append(value.reshape(shape[:-1] + [shape[-1] // (part[1] if part else 1)]))
    return hparams, {name: np.concatenate(p, axis=-1).reshape(shapes[name]) for name, p in parts.items()}


def _h5_value(dataset):
    """A dataset's array; Keras stores bfloat16 as its bits, marked by a `dtype` attribute."""
    value = dataset[()]
    if dataset.attrs.get("dtype") == "bfloat16":
        import ml_dtypes
        value = value.view(ml_dtypes.bfloat16)
    return value


def write_kerashub(hparams, tensors, folder):
    import h5py
    import keras
    if "model/out_head" in tensors:
        raise ConversionError("KerasHub's GPT2Backbone ties its output layer to the token embedding: "
                              "a model with its own output layer (model/out_head) has no KerasHub preset")
    with h5py.File(os.path.join(folder, "model.weights.h5"), "w") as f:
        for key, name, shape, part in kerashub_layout(hparams):
            value = np.reshape(tensors[name], hf_shape(list(np.shape(tensors[name]))))
            if part:
                value = np.split(value, part[1], axis=-1)[part[0]]
            f[key] = np.ascontiguousarray(np.reshape(value, shape), dtype=np.float32)
    tokenizer = _kerashub_tokenizer_config()
    preprocessor = {"module": "keras_hub.src.models.gpt2.gpt2_causal_lm_preprocessor",
                    "class_name": "GPT2CausalLMPreprocessor",
                    "config": {"name": "gpt2_causal_lm_preprocessor", "trainable": True,
                               "dtype": _keras_dtype("float32"), "tokenizer": tokenizer,
                               "config_file": "preprocessor.json", "sequence_length": hparams.n_ctx,
                               "add_start_token": True, "add_end_token": True},
                    "registered_name": "keras_hub>GPT2CausalLMPreprocessor"}
    count = sum(int(np.size(value)) for value in tensors.values())
    metadata = {"keras_version": keras.version(), "parameter_count": count,
                "date_saved": time.strftime("%Y-%m-%d@%H:%M:%S"), "tasks": ["CausalLM"]}
    for name, value in (("tokenizer.json", tokenizer), ("preprocessor.json", preprocessor),
                        ("metadata.json", metadata), ("config.json", kerashub_backbone_config(hparams))):
        _write_json(value, os.path.join(folder, name))
