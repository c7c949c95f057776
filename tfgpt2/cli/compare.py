"""Run OpenAI's original src/ and tfgpt2 on the same checkpoint and prompt, and show where and
by how much they differ: logits, `present` and each block's output, top-5 tokens at every
position, greedy continuations from both, and the time each took.

    tfgpt2 compare --model_dir models/124M --reference_src ../gpt-2/src \\
        --prompt "Every effort moves you" --length 20
    tfgpt2 compare --model_name 124M --reference_src ../gpt-2/src --perturb model/h1/mlp/c_proj/w

Exit status 0 when logits, present and every block are within tolerance, 1 otherwise.
The original runs in a child process (`tfgpt2.testing.reference`); this process stays TF2.
"""
import argparse
import os
import sys

import numpy as np

from ..testing import reference_diff
from .args import Parser, ranged
from .common import add_model_flags, add_quiet, encoder_of, model_dir, parse


def make_parser(prog):
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--reference_src", required=True, type=reference_src,
                        help="src/ of a clone of OpenAI's gpt-2 repository")
    parser.add_argument("--prompt", default="Every effort moves you")
    parser.add_argument("--length", type=ranged(int, 0), default=20, help="tokens of greedy continuation (0: none)")
    parser.add_argument("--atol", type=ranged(float, 0), default=reference_diff.ATOL,
                        help="bound on max abs difference of logits and present (default %(default)s)")
    parser.add_argument("--hidden_rtol", type=ranged(float, 0), default=reference_diff.HIDDEN_RTOL,
                        help="bound on max rel difference of each block's output (default %(default)s)")
    parser.add_argument("--perturb", metavar="VARIABLE",
                        help="self-check: add 1 to the first element of this tfgpt2 variable in memory "
                             "(e.g. model/h1/mlp/c_proj/w); the tool must then exit 1 and name its layer")
    add_quiet(parser)
    return parser


def reference_src(path):
    """An argparse type: a folder with the original model.py and sample.py."""
    missing = [f for f in ("model.py", "sample.py") if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise argparse.ArgumentTypeError(f"{path!r} has no {' or '.join(missing)}; expected the src/ folder "
                                         "of a clone of OpenAI's gpt-2 repository")
    return path


def window_problem(tokens, length, n_ctx):
    """Why the prompt and --length do not fit in n_ctx (the request rules' `check_window`), or None."""
    from ..decoding.request import check_window
    if tokens == 0:
        return "--prompt: the prompt has no tokens; give at least one"
    try:
        check_window(tokens, max(length, 1), n_ctx, names={"prompts": "--prompt", "length": "--length"})
    except ValueError as e:
        return str(e)
    return None


def main(argv=None, prog="tfgpt2 compare"):
    args, progress = parse(make_parser(prog), argv)
    from ..formats.checkpoint import load_model
    from ..testing.reference import Reference, ReferenceError

    try:
        folder = os.path.normpath(model_dir(args))
        encoder = encoder_of(folder)
        progress.note(f"loading {folder}")
        model = load_model(folder)
    except (OSError, ValueError) as e:
        where = f"--model_dir {args.model_dir}: " if args.model_dir else ""
        sys.exit(f"error: {where}{e}")
    tokens = np.array([encoder.encode(args.prompt)], np.int32)
    problem = window_problem(tokens.shape[1], args.length, model.hparams.n_ctx)
    if problem:
        sys.exit(f"error: {problem}")
    if args.perturb:
        try:
            reference_diff.perturb(model, args.perturb)
        except ValueError as e:
            sys.exit(f"error: --perturb {args.perturb}: {e}")
    progress.note(f"running OpenAI's code from {args.reference_src} in a child process beside tfgpt2")
    try:
        with Reference(args.reference_src, folder) as ref:
            comparison = reference_diff.compare(model, ref, tokens, length=args.length,
                                                atol=args.atol, hidden_rtol=args.hidden_rtol)
    except ReferenceError as e:
        sys.exit(f"error: --reference_src {args.reference_src}: OpenAI's code there failed: "
                 f"{str(e).splitlines()[0]}")
    print(f"tfgpt2 vs OpenAI's original ({args.reference_src}) on {folder}, "
          f"{tokens.shape[1]} prompt tokens" + (f", {args.perturb} perturbed" if args.perturb else ""))
    print(reference_diff.report(comparison, encoder.decode))
    return 0 if comparison.ok else 1
