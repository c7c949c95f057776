"""Random-weight GPT-2 model folders in the exact layout OpenAI publishes (`tfgpt2 make-checkpoint`).

Weights are N(0, std) (LayerNorm gains 1 + N(0, std)): larger than GPT-2's init, so that a
wrong mask, scale or epsilon shows in the logits. The vocabulary files are copied in.
"""
import os

import numpy as np

from ..encoder import ASSETS_DIR, VOCAB_FILES
from ..formats.files import copy_file
from ..formats.variables import variable_shapes


def random_weights(hparams, *, std=0.1, seed=0, tie_embeddings=True):
    """Checkpoint name -> float32 array for every variable of `GPT2(hparams)`."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in variable_shapes(hparams, tie_embeddings=tie_embeddings).items():
        value = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        weights[name] = value + 1 if name.endswith("/g") else value
    return weights


def make_checkpoint(model_dir, hparams, *, std=0.1, seed=0, tie_embeddings=True):
    """Write the folder; returns its path."""
    from ..formats.checkpoint import save_checkpoint  # TensorFlow: imported only when writing
    save_checkpoint(random_weights(hparams, std=std, seed=seed, tie_embeddings=tie_embeddings),
                    hparams, model_dir)
    for filename in VOCAB_FILES:
        copy_file(os.path.join(ASSETS_DIR, filename), os.path.join(model_dir, filename))
    return model_dir
