#!/usr/bin/env python3
"""Write a random-weight GPT-2 model folder in the exact layout OpenAI publishes.

    python tools/make_checkpoint.py 124M --models_dir models --std 0.1 --seed 0
    python tools/make_checkpoint.py tiny --hparams '{"n_vocab": 50257, "n_ctx": 64, "n_embd": 32, "n_head": 4, "n_layer": 2}'

Weights are N(0, std) (LayerNorm gains 1 + N(0, std)): larger than GPT-2's init, so that a
wrong mask, scale or epsilon shows in the logits. The vocabulary files are copied in.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tfgpt2.hparams import PUBLISHED, default_hparams, published_hparams  # noqa: E402
from tfgpt2.params import variable_shapes  # noqa: E402

ASSETS = os.path.join(ROOT, "tfgpt2", "assets")


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
    from tfgpt2.checkpoint import save_checkpoint  # TensorFlow: imported only when writing
    save_checkpoint(random_weights(hparams, std=std, seed=seed, tie_embeddings=tie_embeddings),
                    hparams, model_dir)
    for filename in ("encoder.json", "vocab.bpe"):
        shutil.copyfile(os.path.join(ASSETS, filename), os.path.join(model_dir, filename))
    return model_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_name", help=f"folder name; one of {list(PUBLISHED)} gives that size's hparams")
    parser.add_argument("--models_dir", default="models")
    parser.add_argument("--hparams", help="JSON object overriding the hparams (n_vocab, n_ctx, n_embd, n_head, n_layer)")
    parser.add_argument("--std", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untied", action="store_true", help="add a separate output layer model/out_head")
    args = parser.parse_args(argv)
    hparams = published_hparams(args.model_name) if args.model_name in PUBLISHED else \
        default_hparams().override_from_dict({"n_vocab": 50257})
    if args.hparams:
        hparams.override_from_dict(json.loads(args.hparams))
    model_dir = os.path.join(args.models_dir, args.model_name)
    make_checkpoint(model_dir, hparams, std=args.std, seed=args.seed, tie_embeddings=not args.untied)
    print(f"wrote {model_dir} ({hparams.values()}, std {args.std}, seed {args.seed})")


if __name__ == "__main__":
    main()
