"""tfgpt2: OpenAI's GPT-2 (`src/model.py`, `sample.py`, `encoder.py`) in TensorFlow 2 / Keras 3.

Names are imported on first use, so that the tokenizer and the command-line tools that do
not need TensorFlow start without it.
"""
import importlib

_EXPORTS = {
    "HParams": "hparams", "default_hparams": "hparams", "published_hparams": "hparams",
    "load_hparams": "hparams",
    "GPT2": "model", "past_shape": "model",
    "load_model": "checkpoint", "save_model": "checkpoint", "CheckpointError": "checkpoint",
    "count_params": "params", "variable_shapes": "params",
    "get_encoder": "encoder", "default_encoder": "encoder",
    "sample_sequence": "sample", "generate": "sample",
    "export_saved_model": "export",
    "finetune": "train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfgpt2' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
