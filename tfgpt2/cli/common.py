"""What the commands share: --quiet and the progress they show on stderr (`Progress`), the
notices of TensorFlow and Beam kept off the terminal (`Notices`), the model flags (`add_model_flags`, `model_dir`), and the sample scripts' flags, loading, sampling
one batch, printing a sample, and ending without a traceback."""
import argparse
import inspect
import os
import signal
import sys
import tempfile
import time

from tqdm import tqdm

from ..formats.folders import encoder_of, model_folder, model_path
from ..hparams import load_hparams
from .args import Parser, checked, ranged, token_value

DTYPES = ["float32", "bfloat16", "float16", "mixed_bfloat16", "mixed_float16", "int8"]  # Keras dtype policies, int8
DTYPE_HELP = ("the model's Keras dtype policy: bfloat16 halves the memory; int8 makes the blocks' weights int8 "
              "with a scale per column, and the logits' (model.quantize) (default float32)")


def add_quiet(parser):
    """--quiet, as every command has it."""
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (bars, stage lines): only the results, warnings and errors")


def add_tf32(parser):
    """--tf32, on every command that runs a model (as `GPT2`'s `tf32`)."""
    parser.add_argument("--tf32", action="store_true",
                        help="let float32 products use TensorFloat-32 on the GPUs that have it (NVIDIA Ampere "
                             "on): faster, further from float32 (docs/precision.md); default full float32")


def add_text_flags(parser, whose):
    """--encoding of the text `whose` (for example "the text files'"), and --quiet."""
    from ..train.data import check_encoding
    parser.add_argument("--encoding", type=checked(check_encoding), default="utf-8",
                        help=f"{whose} encoding (default utf-8)")
    add_quiet(parser)


class Progress:
    """How a command shows long work, on stderr (stdout keeps the results): `note` writes a
    line for each stage ("loading models/124M"), `bar` is a tqdm bar, drawn only where stderr
    is a terminal. With `quiet` (--quiet) neither shows."""

    def __init__(self, quiet=False):
        self.quiet = bool(quiet)
        self.start = time.monotonic()

    def note(self, message):
        if not self.quiet:
            tqdm.write(message, file=sys.stderr)
            sys.stderr.flush()

    def bar(self, total=None, *, unit, leave=False, position=None, desc=None):
        return tqdm(total=total, unit=unit, leave=leave, position=position, desc=desc, file=sys.stderr,
                    disable=self.quiet or not sys.stderr.isatty())

    def seconds(self):
        """Seconds since the command started."""
        return time.monotonic() - self.start


class Notices:
    """Descriptor 2, this process's stderr and its children's, where TensorFlow and Apache Beam
    write their notices (start-up lines, workers' logs), into a temporary log file while the
    block runs, unless `verbose`. `log` is that file (None when verbose); it is removed on
    leaving unless `keep` was set (a failure the log explains: `where` names it)."""

    def __init__(self, verbose):
        self.verbose, self.log, self.keep, self._saved = verbose, None, False, None

    def __enter__(self):
        if not self.verbose:
            fd, self.log = tempfile.mkstemp(prefix="tfgpt2-", suffix=".log")
            sys.stderr.flush()
            self._saved = os.dup(2)
            os.dup2(fd, 2)
            os.close(fd)
        return self

    def __exit__(self, *exc):
        if self.log:
            sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
            if not self.keep:
                os.remove(self.log)

    def where(self):
        """Where the notices went, as a message names it."""
        return f"the log {self.log}" if self.log else "the log above"


def parse(parser, argv):
    """The arguments, and the Progress that their --quiet asks for."""
    args = parser.parse_args(argv)
    return args, Progress(args.quiet)


def add_model_flags(parser, *, default="124M"):
    """The model to use, as every command takes it: --model_dir, or --model_name in --models_dir."""
    parser.add_argument("--model_name", default=default,
                        help=f"which model: the folder <models_dir>/<model_name> (default {default})")
    parser.add_argument("--models_dir", default="models", help="the folder holding the <model_name> folders")
    parser.add_argument("--model_dir", help="a model or run folder, in place of --models_dir/--model_name")


def model_dir(args):
    """The model folder the flags of `add_model_flags` name; FileNotFoundError says how to get
    a published one that is missing."""
    return model_folder(args.model_name, args.models_dir, args.model_dir)


SAMPLING_HELP = {  # the sampling flags; their types, ranges and defaults are the library's (`decoding.request`)
    "temperature": "lower is less random, 0 is greedy, higher more random (default 1)",
    "top_k": "sample from the k most likely tokens at each step; 0 (default) means no limit, 40 is a good value",
    "top_p": "nucleus sampling: from the most likely tokens whose probabilities add up to p; "
             "1 (default) means no limit",
    "min_p": "keep the tokens at least min_p times as likely as the most likely one (after top-k and top-p); "
             "0 (default) keeps all, 0.05 to 0.1 are usual",
    "repetition_penalty": "CTRL's penalty on every token of the prompt and the sample so far: 1 (default) is off, "
                          "1.2 a usual value",
    "presence_penalty": "OpenAI's: subtracted from the logit of each token the sample already has (default 0)",
    "frequency_penalty": "OpenAI's: subtracted from a token's logit once per time the sample has it (default 0)",
}


def sampling_parser(prog, description, *, nsamples=None, nsamples_min=0, nsamples_help=None, length_help):
    """The original scripts' flags (as --flag value or --flag=value), plus --stop_at_eot;
    --nsamples only where `nsamples` has a default."""
    p = Parser(prog=prog, description=description,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--seed", type=int,
                   help="fix it to reproduce the samples (default: random): sample k uses seed + k, whatever "
                        "--batch_size")
    if nsamples is not None:
        p.add_argument("--nsamples", type=ranged(int, nsamples_min), default=nsamples, help=nsamples_help)
    p.add_argument("--batch_size", type=ranged(int, 1), default=1,
                   help="samples generated at once: more is faster per sample and takes more memory (default 1)")
    p.add_argument("--length", type=int, help=length_help)
    from ..decoding.request import RANGES, check_request
    library = inspect.signature(check_request).parameters
    for field, text in SAMPLING_HELP.items():
        p.add_argument("--" + field, type=RANGES[field].kind, default=library[field].default, help=text)
    p.add_argument("--logit_bias", type=token_value, action="append", metavar="TOKEN_ID=VALUE",
                   help="add VALUE to the token's logit; -100 or -inf bans it (repeat the flag for more tokens)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="end a sample before the first TEXT in it, wherever token boundaries fall (as the server's "
                        "stop); repeat the flag for more")
    p.add_argument("--min_tokens", type=int, default=0, metavar="TOKENS",
                   help="end-of-text (--stop_at_eot) and --stop wait for this many new tokens (default 0)")
    p.add_argument("--context_keep", type=int, metavar="TOKENS",
                   help="let --length go past the model's window: when it is full, go on from the last TOKENS "
                        "tokens (below n_ctx; n_ctx // 2 is usual). Default: refuse such a --length")
    p.add_argument("--stop_at_eot", action="store_true", help="end each sample at its first <|endoftext|>")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help=DTYPE_HELP)
    add_tf32(p)
    add_quiet(p)
    return p


FLAGS = {field: "--" + field for field in (
    "length", "context_keep", "temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "stop", "min_tokens", "stop_at_eot")} | {
    "prompts": "--prompt"}
"""The request's fields as the flags name them, for the request rules' messages (`decoding.request`)."""


def load(args, default_length):
    """The model, its encoder and the request of the flags (`check_flags`; the length
    `default_length(n_ctx)` without --length). Exits with a message for a bad flag or an
    unusable folder."""
    try:
        folder = model_dir(args)
        hparams = load_hparams(folder)
        enc = encoder_of(folder)
        request = check_flags(args, hparams.n_vocab, hparams.n_ctx, default_length(hparams.n_ctx))
        from ..formats.checkpoint import load_model
        model = load_model(folder, dtype=args.dtype, tf32=args.tf32)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    return model, enc, request


def load_litert(args, default_length):
    """`load` for a LiteRT file (--litert): the file, the shipped encoder (or --model_dir's) and
    the request of the flags."""
    try:
        from ..formats.litert import LiteRTModel
        model = LiteRTModel(args.litert)
        enc = encoder_of(args.model_dir or model_path(args.model_name, args.models_dir))
        request = check_flags(args, model.n_vocab, model.n_ctx, default_length(model.n_ctx))
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    return model, enc, request


def check_flags(args, n_vocab, n_ctx, length, *, window=True):
    """The request of the generation flags (`decoding.request.check_request`, before a model
    is loaded), `length` new tokens where --length is not given: ValueError naming the first
    bad flag. With `window`, the original scripts' rule too (exiting with their message):
    without --context_keep, --length is at most n_ctx."""
    from ..decoding.request import check_request, fits
    if window and args.context_keep is None and args.length is not None and not fits(1, args.length, n_ctx):
        sys.exit(f"Can't get samples longer than window size: {n_ctx}")
    return check_request(n_vocab=n_vocab, n_ctx=n_ctx, names=FLAGS,
                         length=length if args.length is None else args.length, **fields(args))


def fields(args):
    """The sampling flags as the request's fields (`decoding.request.check_request`)."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                stop_at_eot=args.stop_at_eot, logit_bias=dict(args.logit_bias or []),
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, min_p=args.min_p, stop=args.stop or [],
                min_tokens=args.min_tokens, context_keep=args.context_keep)


def print_batch(model, enc, args, request, context, batch, first, count):
    """Generate a batch of samples after `context` (token ids) with `request` and print the
    first `count`, numbered from `first`, by the model or a LiteRT file's
    (`formats.litert.LiteRTModel`): the first one as it is generated (a character split across
    tokens printed once whole, nothing a --stop may still claim), the others once the batch is
    done. Sample k of the run (batch `batch` holds samples batch * --batch_size on) uses seed +
    k (`seeds.seed_of`): samples differ, runs repeat, whatever --batch_size. Exits with a line
    saying so where the batch does not fit in memory."""
    import tensorflow as tf
    try:
        _print_batch(model, enc, args, request, context, batch, first, count)
    except (tf.errors.ResourceExhaustedError, MemoryError):
        sys.exit(f"error: out of memory generating --batch_size {args.batch_size} samples of {request.length} "
                 "tokens at once: use a smaller --batch_size")


def _print_batch(model, enc, args, request, context, batch, first, count):
    import dataclasses
    from ..formats.litert import LiteRTModel, complete_litert
    from ..decoding.batch import complete
    from ..seeds import seed_of
    rows = [""] * args.batch_size
    request = dataclasses.replace(request, seed=seed_of(request.seed, batch * args.batch_size))
    with Progress(args.quiet).bar(request.length, unit="token", position=1) as bar:
        told = None if bar.disable else lambda n: bar.update(n - bar.n)
        prompts = [context] * args.batch_size
        if isinstance(model, LiteRTModel):  # a LiteRT file: whole rows
            pieces = [[c.text for c in complete_litert(model, prompts, request, encoder=enc, progress=told)]]
        else:
            pieces = complete(model, prompts, request, encoder=enc, stream=True, chunk=STREAM_EVERY, progress=told)

        def first_row():  # each piece's first row, all rows kept on the way
            for piece in pieces:
                for row, text in enumerate(piece):
                    rows[row] += text
                yield piece[0]
        texts = first_row()
        write(banner(first) + "\n" + next(texts, ""))  # the banner once the batch has started
        for text in texts:
            write(text)
        write("\n")
    for n, text in enumerate(rows[1:count], first + 1):
        show(n, text)


STREAM_EVERY = 8  # tokens between the prints of a sample as it is generated


def write(text):
    """Print text past the progress bars (on stderr), at once."""
    with tqdm.external_write_mode(file=sys.stdout):
        sys.stdout.write(text)
        sys.stdout.flush()


def progress(args, total):
    """A bar counting samples on stderr, shown only where stderr is a terminal and without
    --quiet (beneath it, `print_batch` counts the tokens of each batch as they are generated)."""
    return Progress(args.quiet).bar(total, unit="sample")


def banner(n):
    return "=" * 40 + " SAMPLE " + str(n) + " " + "=" * 40


def show(n, text):
    """Print sample n under the original's banner (past the progress bar)."""
    write(banner(n) + "\n" + text + "\n")


def end_at_once():
    """Ctrl-C ends the command at once, even within a generation, as does a closed stdout
    (`| head`): the default actions of SIGINT and SIGPIPE, no traceback."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored (`&`)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
