"""tfgpt2: OpenAI's GPT-2 (`src/model.py`, `sample.py`, `encoder.py`) in TensorFlow 2 / Keras 3.

Names are imported on first use, so that the tokenizer and the commands that do not need
TensorFlow start without it. `keras.models.load_model` of a tfgpt2 `.keras` file needs only
`import tfgpt2`: Keras asks for the class by its registered name "tfgpt2>GPT2", and the
lookup below imports `tfgpt2.model`, which registers it.
"""
import importlib

_EXPORTS = {
    "HParams": "hparams", "default_hparams": "hparams", "published_hparams": "hparams",
    "load_hparams": "hparams", "count_params": "hparams", "variable_shapes": "hparams",
    "GPT2": "model", "past_shape": "model",
    "load_model": "formats.checkpoint", "save_model": "formats.checkpoint",
    "CheckpointError": "formats.checkpoint",
    "get_encoder": "encoder", "default_encoder": "encoder",
    "sample_sequence": "sample", "generate": "sample",
    "export_saved_model": "formats.saved_model",
    "convert": "formats.convert",
    "finetune": "train.flags",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfgpt2' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
