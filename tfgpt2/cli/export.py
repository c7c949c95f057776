"""Export a GPT-2 model folder as a SavedModel for TensorFlow Serving (docs/serving.md).

    tfgpt2 export --model_dir models/124M --export_dir exports/gpt2
    saved_model_cli show --dir exports/gpt2/1 --all

Writes `<export_dir>/<version>/` with the signatures `serving_default` (logits) and
`generate` (XLA generation loop).
"""
import argparse
import os
import sys
import time

from ..encoder import EOT_TOKEN
from .common import DTYPES


def main(argv=None, prog="tfgpt2 export"):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="a model folder (hparams.json, model.ckpt.*)")
    parser.add_argument("--export_dir", required=True, help="the model's base path for TF Serving")
    parser.add_argument("--version", type=int, default=1, help="version subfolder (default 1); never overwritten")
    parser.add_argument("--stop_at_eot", action="store_true",
                        help="generate: a row stops after <|endoftext|> (fixed for every request)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the Keras dtype policy to export with: bfloat16 halves the variables (default float32)")
    parser.add_argument("--eot", type=int, default=EOT_TOKEN, help=f"the <|endoftext|> id (default {EOT_TOKEN})")
    args = parser.parse_args(argv)
    from ..formats.saved_model import checkpoint_bytes, export_saved_model, folder_bytes
    start = time.perf_counter()
    try:
        path = export_saved_model(args.model_dir, args.export_dir, args.version,
                                  stop_at_eot=args.stop_at_eot, eot=args.eot, dtype=args.dtype)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        parser.exit(1, f"error: {e}\n")
    seconds = time.perf_counter() - start
    print(f"wrote {path} in {seconds:.1f} s: variables {folder_bytes(os.path.join(path, 'variables')) / 1e6:.1f} MB "
          f"(checkpoint {checkpoint_bytes(args.model_dir) / 1e6:.1f} MB), {folder_bytes(path) / 1e6:.1f} MB in all")
    print(f"inspect: saved_model_cli show --dir {path} --all")
    return 0
