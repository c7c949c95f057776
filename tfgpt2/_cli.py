"""What the two sample scripts share: their flags, loading, sampling one batch, printing a
sample, and ending without a traceback."""
import argparse
import math
import os
import signal
import sys

from tqdm import tqdm

import tfgpt2
from .hparams import load_hparams, missing_model

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's notices, before it is imported
DTYPES = ["float32", "bfloat16", "float16", "mixed_bfloat16", "mixed_float16"]  # Keras dtype policies


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (naming the flag and the value) instead of
    the usage text before it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser(module, description, *, nsamples=None, nsamples_min=0, nsamples_help=None, length_help):
    """The original scripts' flags (as --flag value or --flag=value), plus --stop_at_eot;
    --nsamples only where `nsamples` has a default."""
    p = Parser(prog=f"python -m {module}", description=description,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name", default="124M", help="which model: the folder <models_dir>/<model_name>")
    p.add_argument("--seed", type=ranged(int, 0, 2**32 - 1),
                   help="fix it to reproduce the samples (default: random); they depend on --batch_size "
                        "too, so keep it the same")
    if nsamples is not None:
        p.add_argument("--nsamples", type=ranged(int, nsamples_min), default=nsamples, help=nsamples_help)
    p.add_argument("--batch_size", type=ranged(int, 1), default=1,
                   help="samples generated at once: more is faster per sample and takes more memory; "
                        "with --seed another batch size gives other samples (default 1)")
    p.add_argument("--length", type=ranged(int, 1), help=length_help)
    p.add_argument("--temperature", type=ranged(float, 0), default=1.0,
                   help="lower is less random, 0 is greedy, higher more random (default 1)")
    p.add_argument("--top_k", type=ranged(int, 0), default=0,
                   help="sample from the k most likely tokens at each step; 0 (default) means no limit, "
                        "40 is a good value")
    p.add_argument("--top_p", type=ranged(float, 0, 1), default=1.0,
                   help="nucleus sampling: from the most likely tokens whose probabilities add up to p; "
                        "1 (default) means no limit")
    p.add_argument("--models_dir", default="models", help="the folder holding the <model_name> folders")
    p.add_argument("--stop_at_eot", action="store_true", help="end each sample at its first <|endoftext|>")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the model's Keras dtype policy: bfloat16 halves the memory (default float32)")
    return p


def ranged(kind, low, high=None):
    """An argparse type: a finite `kind` (int or float) from `low` to `high` (no limit if None)."""
    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (high is not None and value > high):
            what = "an integer" if kind is int else "a number"
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {what} {bounds}, got {text!r}")
        return value
    return convert


def load(args, default_length):
    """The model, its encoder and the number of tokens to generate (`default_length(n_ctx)`
    without --length). Exits with a message for a length over n_ctx or an unusable folder."""
    models_dir = os.path.expanduser(os.path.expandvars(args.models_dir))
    model_dir = os.path.join(models_dir, args.model_name)
    try:
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(missing_model(args.model_name, models_dir))
        n_ctx = load_hparams(model_dir).n_ctx
        if args.length is not None and args.length > n_ctx:
            sys.exit(f"Can't get samples longer than window size: {n_ctx}")
        enc = tfgpt2.get_encoder(args.model_name, models_dir)
        model = tfgpt2.load_model(model_dir, dtype=args.dtype)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    return model, enc, default_length(n_ctx) if args.length is None else args.length


def sample_batch(model, enc, args, length, context, batch):
    """The texts generated after `context` (token ids), one per row of the batch. With --seed,
    batch number `batch` of the run uses seed + batch: batches differ, runs repeat."""
    with tqdm(total=length, unit="token", leave=False, position=1, disable=not sys.stderr.isatty()) as bar:
        out = tfgpt2.sample_sequence(
            model=model, length=length, context=[context] * args.batch_size,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=None if args.seed is None else args.seed + batch, stop_at_eot=args.stop_at_eot,
            progress=None if bar.disable else lambda n: bar.update(n - bar.n))
    return [enc.decode(row[len(context):]) for row in out]


def progress(total):
    """A bar counting samples on stderr, shown only where stderr is a terminal (beneath it,
    `sample_batch` counts the tokens of each batch as they are generated)."""
    return tqdm(total=total, unit="sample", leave=False, disable=not sys.stderr.isatty())


def show(n, text):
    """Print sample n under the original's banner (past the progress bar)."""
    tqdm.write("=" * 40 + " SAMPLE " + str(n) + " " + "=" * 40 + "\n" + text)
    sys.stdout.flush()


def run(main):
    """Run main() as a command that Ctrl-C ends at once, even within a generation, as does a
    closed stdout (`| head`): the default actions of SIGINT and SIGPIPE, no traceback."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored (`&`)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
