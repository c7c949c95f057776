"""Parameter counts, from hparams alone or from a built model.

    tfgpt2 params --model_name 124M
    tfgpt2 params --model_dir models/124M
"""
import argparse
import os

from ..hparams import PUBLISHED, breakdown, load_hparams, missing_model, published_hparams


def main(argv=None, prog="tfgpt2 params"):
    parser = argparse.ArgumentParser(prog=prog, description="Print GPT-2's parameter count, part by part.")
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
