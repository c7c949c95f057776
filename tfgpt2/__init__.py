"""tfgpt2: OpenAI's GPT-2 (`src/model.py`, `sample.py`, `encoder.py`) in TensorFlow 2 / Keras 3.

`import tfgpt2` imports `tfgpt2.model` at once, as `import keras_hub` does its models: that
registers GPT2 and its layers with Keras, so that `keras.models.load_model("gpt2.keras")` of a
saved tfgpt2 model needs nothing more (Keras looks the classes up by their registered names,
"tfgpt2>GPT2", and imports no module to find them). It also means `import tfgpt2` imports
TensorFlow and Keras (quietly, and without matplotlib, where tfgpt2 runs as a command:
`_startup`). The other names below are imported on first use.
"""
import importlib

from ._startup import as_command, quietly, without_plots

with quietly(as_command()), without_plots(as_command()):  # a command's start: no TensorFlow lines, no plots
    from . import model  # noqa: F401  registers the Keras classes

_EXPORTS = {
    "HParams": "hparams", "default_hparams": "hparams", "published_hparams": "hparams",
    "load_hparams": "hparams", "count_params": "formats.variables", "variable_shapes": "formats.variables",
    "GPT2": "model", "past_shape": "model",
    "load_model": "formats.checkpoint", "save_model": "formats.checkpoint",
    "CheckpointError": "formats.checkpoint",
    "get_encoder": "encoder", "default_encoder": "encoder",
    "sample_sequence": "sample", "generate": "sample",
    "export_saved_model": "formats.saved_model",
    "export_litert": "formats.litert", "generate_litert": "formats.litert",
    "convert": "formats.hf_kerashub",
    "finetune": "train.loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfgpt2' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
