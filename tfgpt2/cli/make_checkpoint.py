"""Write a random-weight GPT-2 model folder in the exact layout OpenAI publishes, for offline
use and tests: everything works on it as on a download, with meaningless text.

    tfgpt2 make-checkpoint 124M --models_dir models --std 0.1 --seed 0
    tfgpt2 make-checkpoint tiny --hparams '{"n_vocab": 50257, "n_ctx": 64, "n_embd": 32, "n_head": 4, "n_layer": 2}'

Weights are N(0, std) (LayerNorm gains 1 + N(0, std)). The vocabulary files are copied in.
A published size (or Hugging Face's name of it: gpt2, gpt2-medium, gpt2-large, gpt2-xl) has
its own hparams; any other name needs --hparams (over 124M's). A folder with files in it is
never written over without --overwrite (it may hold downloaded weights).
"""
import argparse
import json

from ..formats.files import refuse_existing
from ..formats.folders import model_path
from ..hparams import ALIASES, PUBLISHED, default_hparams, published_hparams, published_name
from ..seeds import SEEDS
from .args import Parser, checked_range, ranged
from .common import Progress, add_quiet


def main(argv=None, prog="tfgpt2 make-checkpoint"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_name", help=f"folder name; one of {', '.join(PUBLISHED)} (or {', '.join(ALIASES)}) "
                                           "gives that size's hparams, any other needs --hparams")
    parser.add_argument("--models_dir", default="models")
    parser.add_argument("--hparams", help="JSON object overriding the hparams (n_vocab, n_ctx, n_embd, n_head, n_layer)")
    parser.add_argument("--std", type=ranged(float, 0), default=0.1, help="the weights' standard deviation (default 0.1)")
    parser.add_argument("--seed", type=checked_range(SEEDS), default=0, help="the weights' seed (default 0)")
    parser.add_argument("--untied", action="store_true", help="add a separate output layer model/out_head")
    parser.add_argument("--overwrite", action="store_true", help="write into a folder that has files (replacing them)")
    add_quiet(parser)
    args = parser.parse_args(argv)
    name = published_name(args.model_name)
    if name not in PUBLISHED and not args.hparams:
        parser.error(f"{args.model_name!r} is no published size ({', '.join(PUBLISHED)}): give its shape with "
                     "--hparams")
    hparams = published_hparams(name) if name in PUBLISHED else default_hparams().override_from_dict({"n_vocab": 50257})
    if args.hparams:
        try:
            overrides = json.loads(args.hparams)
            if not isinstance(overrides, dict):
                raise ValueError("not a JSON object")
            hparams.override_from_dict(overrides)
        except ValueError as e:
            parser.error(f"argument --hparams: {e}")
    model_dir = model_path(name, args.models_dir)
    from ..testing.checkpoints import make_checkpoint
    try:
        if not args.overwrite:
            refuse_existing(model_dir)
        Progress(args.quiet).note(f"writing random weights to {model_dir}")
        make_checkpoint(model_dir, hparams, std=args.std, seed=args.seed, tie_embeddings=not args.untied)
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {model_dir} ({hparams.values()}, std {args.std}, seed {args.seed})")
    return 0
