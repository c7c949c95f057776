"""Export a GPT-2 model as a SavedModel for TensorFlow Serving (docs/serving.md), or as a
LiteRT file for phones and small devices (docs/litert.md).

    tfgpt2 export --model_name 124M exports/gpt2
    tfgpt2 export --model_dir checkpoint/run1 exports/run1 --version 2 --stop_at_eot
    saved_model_cli show --dir exports/gpt2/1 --all
    tfgpt2 export --format litert --quantize int8 --model_name 124M gpt2-int8.tflite

SavedModel: writes `<export_dir>/<version>/` with the signatures `serving_default` (logits)
and `generate` (XLA generation loop); an existing version is never replaced. LiteRT: writes
the file, with the signatures `prefill` and `decode`, which
`tfgpt2 generate --litert FILE --nsamples 1` runs; an existing file is replaced only with
--overwrite. The model is given as to the other commands: --model_dir, or --model_name in
--models_dir.
"""
import argparse
import os

from ..encoder import EOT_TOKEN
from ..formats.files import refuse_existing
from ..formats.litert import QUANTIZE
from .args import Parser, ranged
from .common import DTYPES, add_model_flags, add_quiet, add_tf32, model_dir, parse


def main(argv=None, prog="tfgpt2 export"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir", nargs="?", metavar="EXPORT_DIR",
                        help="the model's base path for TF Serving (the .tflite file with --format litert)")
    parser.add_argument("--export_dir", dest="export_dir_flag", metavar="EXPORT_DIR", help="the same as EXPORT_DIR")
    add_model_flags(parser)
    parser.add_argument("--version", type=ranged(int, 0), default=1,
                        help="version subfolder (default 1); never overwritten")
    parser.add_argument("--stop_at_eot", action="store_true",
                        help="generate: a row stops after <|endoftext|> (fixed for every request)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the Keras dtype policy to export with: bfloat16 halves the variables; int8 makes "
                        "the blocks' weights int8 with a scale per column, and the logits' (default float32)")
    parser.add_argument("--eot", type=int, default=EOT_TOKEN, help=f"the <|endoftext|> id (default {EOT_TOKEN})")
    parser.add_argument("--format", default="saved_model", choices=["saved_model", "litert"],
                        help="a SavedModel folder (default) or a LiteRT .tflite file")
    parser.add_argument("--quantize", choices=QUANTIZE,
                        help="LiteRT only: the weights as float32 (none, the default), float16 or int8")
    parser.add_argument("--overwrite", action="store_true",
                        help="LiteRT only: replace an existing file (a SavedModel version is never replaced)")
    add_tf32(parser)
    add_quiet(parser)
    args, progress = parse(parser, argv)
    if args.export_dir and args.export_dir_flag and args.export_dir != args.export_dir_flag:
        parser.error(f"two export folders: {args.export_dir} and --export_dir {args.export_dir_flag}")
    export_dir = args.export_dir or args.export_dir_flag
    if not export_dir:
        parser.error("the export folder is missing: tfgpt2 export [--model_name NAME | --model_dir DIR] EXPORT_DIR")
    if args.format == "litert":
        return export_litert_file(parser, args, progress, export_dir)
    if args.quantize:
        parser.error("--quantize applies to --format litert (a SavedModel takes --dtype)")
    if args.overwrite:
        parser.error("--overwrite applies to --format litert (a SavedModel version is never replaced: "
                     "export another --version)")
    from ..formats.checkpoint import load_model
    from ..formats.saved_model import checkpoint_bytes, export_saved_model, folder_bytes
    try:
        folder = model_dir(args)
        target = os.path.join(export_dir, str(args.version))
        if os.path.exists(target):  # before the model is loaded (export_saved_model checks again)
            raise FileExistsError(f"{target} exists; export another version or remove it")
        progress.note(f"loading {folder} ({args.dtype})")
        model = load_model(folder, dtype=args.dtype, tf32=args.tf32)
        progress.note(f"tracing the serving_default and generate signatures and writing {target}")
        path = export_saved_model(model, export_dir, args.version, stop_at_eot=args.stop_at_eot, eot=args.eot)
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {path} in {progress.seconds():.1f} s: variables "
          f"{folder_bytes(os.path.join(path, 'variables')) / 1e6:.1f} MB (checkpoint "
          f"{checkpoint_bytes(folder) / 1e6:.1f} MB), {folder_bytes(path) / 1e6:.1f} MB in all")
    print(f"inspect: saved_model_cli show --dir {path} --all")
    return 0


def export_litert_file(parser, args, progress, path):
    """--format litert: the LiteRT file at `path` (float32 weights, quantized by --quantize)."""
    given = [flag for flag, value in (("--version", args.version != 1), ("--stop_at_eot", args.stop_at_eot),
                                      ("--dtype", args.dtype != "float32"), ("--eot", args.eot != EOT_TOKEN),
                                      ("--tf32", args.tf32)) if value]
    if given:
        parser.error(f"{', '.join(given)} do not apply to --format litert (it takes --quantize)")
    from ..formats.checkpoint import load_model
    from ..formats.litert import export_litert
    quantize = args.quantize or "none"
    try:
        if not args.overwrite:
            refuse_existing(path)
        folder = model_dir(args)
        progress.note(f"loading {folder}")
        model = load_model(folder)
        progress.note(f"converting to LiteRT (quantize {quantize}) and writing {path}")
        export_litert(model, path, quantize=quantize)
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {path} in {progress.seconds():.1f} s: {os.path.getsize(path) / 1e6:.1f} MB "
          f"(signatures prefill and decode; run it: tfgpt2 generate --litert {path} --nsamples 1)")
    return 0
