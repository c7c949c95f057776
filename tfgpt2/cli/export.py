"""Export a GPT-2 model as a SavedModel for TensorFlow Serving (docs/serving.md).

    tfgpt2 export --model_name 124M exports/gpt2
    tfgpt2 export --model_dir checkpoint/run1 exports/run1 --version 2 --stop_at_eot
    saved_model_cli show --dir exports/gpt2/1 --all

Writes `<export_dir>/<version>/` with the signatures `serving_default` (logits) and
`generate` (XLA generation loop). The model is given as to the other commands: --model_dir,
or --model_name in --models_dir.
"""
import argparse
import os

from ..encoder import EOT_TOKEN
from .args import Parser, ranged
from .common import DTYPES, Progress, add_model_flags, add_quiet, model_dir


def main(argv=None, prog="tfgpt2 export"):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir", nargs="?", metavar="EXPORT_DIR", help="the model's base path for TF Serving")
    parser.add_argument("--export_dir", dest="export_dir_flag", metavar="EXPORT_DIR", help="the same as EXPORT_DIR")
    add_model_flags(parser)
    parser.add_argument("--version", type=ranged(int, 0), default=1,
                        help="version subfolder (default 1); never overwritten")
    parser.add_argument("--stop_at_eot", action="store_true",
                        help="generate: a row stops after <|endoftext|> (fixed for every request)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the Keras dtype policy to export with: bfloat16 halves the variables (default float32)")
    parser.add_argument("--eot", type=int, default=EOT_TOKEN, help=f"the <|endoftext|> id (default {EOT_TOKEN})")
    add_quiet(parser)
    args = parser.parse_args(argv)
    if args.export_dir and args.export_dir_flag and args.export_dir != args.export_dir_flag:
        parser.error(f"two export folders: {args.export_dir} and --export_dir {args.export_dir_flag}")
    export_dir = args.export_dir or args.export_dir_flag
    if not export_dir:
        parser.error("the export folder is missing: tfgpt2 export [--model_name NAME | --model_dir DIR] EXPORT_DIR")
    from ..formats.checkpoint import load_model
    from ..formats.saved_model import checkpoint_bytes, export_saved_model, folder_bytes
    progress = Progress(args.quiet)
    try:
        folder = model_dir(args)
        target = os.path.join(export_dir, str(args.version))
        if os.path.exists(target):  # before the model is loaded (export_saved_model checks again)
            raise FileExistsError(f"{target} exists; export another version or remove it")
        progress.note(f"loading {folder} ({args.dtype})")
        model = load_model(folder, dtype=args.dtype)
        progress.note(f"tracing the serving_default and generate signatures and writing {target}")
        path = export_saved_model(model, export_dir, args.version, stop_at_eot=args.stop_at_eot, eot=args.eot)
    except (OSError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"wrote {path} in {progress.seconds():.1f} s: variables "
          f"{folder_bytes(os.path.join(path, 'variables')) / 1e6:.1f} MB (checkpoint "
          f"{checkpoint_bytes(folder) / 1e6:.1f} MB), {folder_bytes(path) / 1e6:.1f} MB in all")
    print(f"inspect: saved_model_cli show --dir {path} --all")
    return 0
