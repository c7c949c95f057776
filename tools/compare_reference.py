#!/usr/bin/env python3
"""Run OpenAI's original src/ and tfgpt2 on the same checkpoint and prompt, and show where and
by how much they differ: logits, `present` and each block's output, top-5 tokens at every
position, greedy continuations from both, and the time each took.

    python tools/compare_reference.py --model_dir models/124M --reference_src ../gpt-2/src \\
        --prompt "Every effort moves you" --length 20

Exit status 0 when logits, present and every block are within tolerance, 1 otherwise.
The original runs in a child process (see tfgpt2/reference.py); this process stays TF2.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tfgpt2 import compare  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="a model folder (hparams.json, checkpoint, vocabulary)")
    parser.add_argument("--reference_src", required=True, help="src/ of a clone of OpenAI's gpt-2 repository")
    parser.add_argument("--prompt", default="Every effort moves you")
    parser.add_argument("--length", type=int, default=20, help="tokens of greedy continuation (0: none)")
    parser.add_argument("--atol", type=float, default=compare.ATOL,
                        help="bound on max abs difference of logits and present (default %(default)s)")
    parser.add_argument("--hidden_rtol", type=float, default=compare.HIDDEN_RTOL,
                        help="bound on max rel difference of each block's output (default %(default)s)")
    parser.add_argument("--perturb", metavar="VARIABLE",
                        help="self-check: add 1 to the first element of this tfgpt2 variable in memory "
                             "(e.g. model/h1/mlp/c_proj/w); the tool must then exit 1 and name its layer")
    args = parser.parse_args(argv)
    if args.length < 0:
        parser.error("--length must be >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    from tfgpt2.checkpoint import load_model
    from tfgpt2.encoder import get_encoder
    from tfgpt2.reference import Reference

    model_dir = os.path.normpath(args.model_dir)
    encoder = get_encoder(os.path.basename(model_dir), os.path.dirname(model_dir))
    tokens = np.array([encoder.encode(args.prompt)], np.int32)
    model = load_model(model_dir)
    n_ctx = model.hparams.n_ctx
    if not 0 < tokens.shape[1] <= n_ctx - args.length:
        sys.exit(f"error: the prompt has {tokens.shape[1]} tokens; it needs 1 to n_ctx - length = "
                 f"{n_ctx - args.length}")
    if args.perturb:
        compare.perturb(model, args.perturb)
    with Reference(args.reference_src, model_dir) as ref:
        comparison = compare.compare(model, ref, tokens, length=args.length,
                                     atol=args.atol, hidden_rtol=args.hidden_rtol)
    print(f"tfgpt2 vs OpenAI's original ({args.reference_src}) on {model_dir}, "
          f"{tokens.shape[1]} prompt tokens" + (f", {args.perturb} perturbed" if args.perturb else ""))
    print(compare.report(comparison, encoder.decode))
    return 0 if comparison.ok else 1


if __name__ == "__main__":
    sys.exit(main())
