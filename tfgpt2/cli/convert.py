"""Convert GPT-2 weights between OpenAI's layout, Hugging Face's and KerasHub presets.

    tfgpt2 convert --from openai --to hf models/124M exports/gpt2-hf
    tfgpt2 convert --from hf --to openai path/to/gpt2-hf models/gpt2-hf
    tfgpt2 convert --from openai --to kerashub models/124M exports/gpt2-kerashub

openai: hparams.json + model.ckpt.* (SRC may be a model name: models/<name>);
hf: config.json + model.safetensors (never pytorch_model.bin);
kerashub: a preset folder for keras_hub.models.GPT2CausalLM.from_preset.
DST is a new or empty folder; with --overwrite, files in it of the same names are replaced. A
training run folder (`tfgpt2 train`'s) is refused: its next run would resume from DST's weights.
Progress: a line on stderr before the work and its time after; --quiet leaves the result line.
"""
import argparse

from ..formats.files import refuse_existing
from ..formats.folders import find_model_dir
from ..formats.hf_kerashub import FORMATS, convert
from ..train.run_folder import refuse_run_folder
from .args import Parser
from .common import add_quiet, parse


def main(argv=None, prog="tfgpt2 convert"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="src_format", required=True, choices=FORMATS, help="SRC's layout")
    parser.add_argument("--to", dest="dst_format", required=True, choices=FORMATS, help="DST's layout")
    parser.add_argument("--models_dir", default="models", help="where a model name in SRC is looked up (openai)")
    parser.add_argument("src", metavar="SRC", help="the folder to read")
    parser.add_argument("dst", metavar="DST", help="the folder to write: new or empty (see --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a folder that has files, replacing those of the same names")
    add_quiet(parser)
    args, progress = parse(parser, argv)
    try:
        refuse_run_folder(args.dst)
        if not args.overwrite:
            refuse_existing(args.dst)
        src = args.src
        if args.src_format == "openai":
            src = find_model_dir(src, args.models_dir)
        progress.note(f"reading {src} ({args.src_format}) and writing {args.dst} ({args.dst_format})")
        convert(src, args.dst, src_format=args.src_format, dst_format=args.dst_format)
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {args.dst} ({args.dst_format}) from {src} ({args.src_format}) in {progress.seconds():.1f} s")
    return 0
