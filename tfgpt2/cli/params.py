"""Print GPT-2's parameter count, part by part, from hparams alone (no weights are read).

    tfgpt2 params 124M
    tfgpt2 params --model_name 1558M
    tfgpt2 params --model_dir models/124M
    tfgpt2 params --model_name 124M --models_dir models

MODEL is a published size (124M, 355M, 774M, 1558M, or Hugging Face's gpt2, gpt2-medium,
gpt2-large, gpt2-xl) or a model folder with hparams.json.
"""
import argparse
import os

from ..formats.folders import model_folder
from ..formats.variables import breakdown
from ..hparams import ALIASES, PUBLISHED, load_hparams, published_hparams, published_name
from .args import Parser
from .common import add_quiet


def main(argv=None, prog="tfgpt2 params"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", metavar="MODEL", help="a published size or a model folder")
    parser.add_argument("--model_name", choices=[*PUBLISHED, *ALIASES], help="a published size")
    parser.add_argument("--model_dir", help="a model folder with hparams.json")
    parser.add_argument("--models_dir", help="with --model_name: read <models_dir>/<model_name>/hparams.json")
    add_quiet(parser)
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.model, args.model_name, args.model_dir)) != 1:
        parser.error("give one model: MODEL, --model_name or --model_dir")
    if args.model is not None:
        if published_name(args.model) in PUBLISHED:
            args.model_name = args.model
        elif os.path.isdir(args.model):
            args.model_dir = args.model
        else:
            parser.error(f"argument MODEL: {args.model!r} is neither a published size "
                         f"({', '.join(PUBLISHED)}) nor a folder")
    try:
        if args.model_dir or args.models_dir:
            hparams = load_hparams(model_folder(args.model_name, args.models_dir, args.model_dir))
        else:
            hparams = published_hparams(args.model_name)
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"hparams: {hparams.values()}")
    for part, count in breakdown(hparams):
        print(f"{part:<28}{count:>16,}")
    return 0
