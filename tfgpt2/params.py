"""Parameter counts, from hparams alone or from a built model.

    python -m tfgpt2.params --model_name 124M
    python -m tfgpt2.params --model_dir models/124M
"""
import argparse
import math
import os

from .hparams import PUBLISHED, load_hparams, missing_model, published_hparams


def variable_shapes(hparams, *, tie_embeddings=True):
    """Checkpoint name -> shape of every variable `GPT2(hparams)` owns, without building it."""
    nx, hp = hparams.n_embd, hparams
    shapes = {"model/wpe": [hp.n_ctx, nx], "model/wte": [hp.n_vocab, nx]}
    block = {"ln_1/g": [nx], "ln_1/b": [nx],
             "attn/c_attn/w": [1, nx, 3 * nx], "attn/c_attn/b": [3 * nx],
             "attn/c_proj/w": [1, nx, nx], "attn/c_proj/b": [nx],
             "ln_2/g": [nx], "ln_2/b": [nx],
             "mlp/c_fc/w": [1, nx, 4 * nx], "mlp/c_fc/b": [4 * nx],
             "mlp/c_proj/w": [1, 4 * nx, nx], "mlp/c_proj/b": [nx]}
    for layer in range(hp.n_layer):
        shapes.update({f"model/h{layer}/{name}": shape for name, shape in block.items()})
    shapes.update({"model/ln_f/g": [nx], "model/ln_f/b": [nx]})
    if not tie_embeddings:
        shapes["model/out_head"] = [hp.n_vocab, nx]
    return shapes


def count_params(model):
    """Parameters of a built model, each variable counted once (the tied `wte` included)."""
    unique = {id(v): v for v in model.weights}
    return sum(math.prod(v.shape) for v in unique.values())


def breakdown(hparams):
    """(part, count) rows: embeddings, one block, all blocks, final norm, output layer, totals."""
    shapes = variable_shapes(hparams)
    size = {name: math.prod(shape) for name, shape in shapes.items()}
    block = sum(n for name, n in size.items() if name.startswith("model/h0/"))
    tied = sum(size.values())
    head = hparams.n_vocab * hparams.n_embd
    return [
        ("token embedding wte", size["model/wte"]),
        ("position embedding wpe", size["model/wpe"]),
        ("one block", block),
        (f"{hparams.n_layer} blocks", block * hparams.n_layer),
        ("final norm ln_f", size["model/ln_f/g"] + size["model/ln_f/b"]),
        ("output layer, tied to wte", 0),
        ("output layer, untied", head),
        ("total, tied", tied),
        ("total, untied", tied + head),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print GPT-2's parameter count, part by part.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--model_name", choices=list(PUBLISHED), help="a published size")
    group.add_argument("--model_dir", help="a model folder with hparams.json")
    parser.add_argument("--models_dir", help="with --model_name: read <models_dir>/<model_name>/hparams.json")
    args = parser.parse_args(argv)
    if args.model_dir:
        hparams = load_hparams(args.model_dir)
    elif args.models_dir:
        if not os.path.isdir(os.path.join(args.models_dir, args.model_name)):
            parser.exit(1, f"error: {missing_model(args.model_name, args.models_dir)}\n")
        hparams = load_hparams(os.path.join(args.models_dir, args.model_name))
    else:
        hparams = published_hparams(args.model_name)
    print(f"hparams: {hparams.values()}")
    for part, count in breakdown(hparams):
        print(f"{part:<28}{count:>16,}")


if __name__ == "__main__":
    main()
