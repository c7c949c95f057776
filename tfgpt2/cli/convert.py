"""Convert GPT-2 weights between OpenAI's layout, Hugging Face's and KerasHub presets, or
write them as a GGUF file for llama.cpp.

    tfgpt2 convert --from openai --to hf models/124M exports/gpt2-hf
    tfgpt2 convert --from hf --to openai path/to/gpt2-hf models/gpt2-hf
    tfgpt2 convert --from openai --to kerashub models/124M exports/gpt2-kerashub
    tfgpt2 convert --from openai --to gguf models/124M exports/gpt2-124M-f16.gguf --outtype f16

openai: hparams.json + model.ckpt.* (SRC may be a model name: models/<name>);
hf: config.json + model.safetensors (never pytorch_model.bin);
kerashub: a preset folder for keras_hub.models.GPT2CausalLM.from_preset;
gguf (--to only): one file for llama.cpp, its matrices in --outtype (f32, f16 or q8_0), the
tokenizer with it. An openai SRC may be a training run folder (its latest model-<step>).
DST is a new or empty folder (a new file for gguf); with --overwrite, files in it of the same
names are replaced. A training run folder (`tfgpt2 train`'s) is refused as DST: its next run
would resume from DST's weights.
Progress: a line on stderr before the work and its time after; --quiet leaves the result line.
"""
import argparse
import importlib.util

from ..formats.files import refuse_existing
from ..formats.folders import find_model_dir
from ..formats.gguf_file import OUTTYPES, export_gguf
from ..formats.hf_kerashub import FORMATS, convert
from ..train.run_folder import refuse_run_folder
from .args import Parser
from .common import add_quiet, parse


def main(argv=None, prog="tfgpt2 convert"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="src_format", required=True, choices=FORMATS, help="SRC's layout")
    parser.add_argument("--to", dest="dst_format", required=True, choices=FORMATS + ("gguf",), help="DST's layout")
    parser.add_argument("--outtype", choices=OUTTYPES,
                        help="gguf only: the type of the matrices (default f16, as llama.cpp's converter)")
    parser.add_argument("--models_dir", default="models", help="where a model name in SRC is looked up (openai)")
    parser.add_argument("src", metavar="SRC", help="the folder to read")
    parser.add_argument("dst", metavar="DST", help="the folder to write: new or empty (see --overwrite); "
                        "for gguf, a new file")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a folder that has files, replacing those of the same names")
    add_quiet(parser)
    args, progress = parse(parser, argv)
    if args.outtype and args.dst_format != "gguf":
        parser.error("--outtype is for --to gguf only")
    if args.dst_format == "gguf" and importlib.util.find_spec("gguf") is None:
        parser.exit(1, "error: gguf is missing: tfgpt2 convert --to gguf needs pip install 'tfgpt2[gguf]'\n")
    try:
        refuse_run_folder(args.dst)
        if not args.overwrite:
            refuse_existing(args.dst)
        src = args.src
        if args.src_format == "openai":
            src = find_model_dir(src, args.models_dir)
        progress.note(f"reading {src} ({args.src_format}) and writing {args.dst} ({args.dst_format})")
        if args.dst_format == "gguf":
            export_gguf(src, args.dst, src_format=args.src_format, outtype=args.outtype or "f16")
        else:
            convert(src, args.dst, src_format=args.src_format, dst_format=args.dst_format)
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    written = f"{args.dst_format} {args.outtype or 'f16'}" if args.dst_format == "gguf" else args.dst_format
    print(f"wrote {args.dst} ({written}) from {src} ({args.src_format}) in {progress.seconds():.1f} s")
    return 0
