r"""Continue prompts, as OpenAI's `src/interactive_conditional_samples.py` does, with its
flags and output:

    tfgpt2 interactive --model_name 124M --top_k 40
    printf 'First prompt\nSecond prompt\n' | tfgpt2 interactive --length 20 --seed 1

On a terminal it asks "Model prompt >>> "; otherwise it reads one prompt per line of stdin,
without asking, and says "Prompt should not be empty!" on stderr. It ends at end of input
(Ctrl-D) with status 0. Each prompt gets --nsamples samples (default 1; --batch_size must
divide it) of --length tokens (default n_ctx // 2), then a line of 80 "=". A prompt too long
for the model's window with --length more tokens gets an error naming its line, and no
samples. With --seed, a run repeats exactly: sample k of the run, counted over all prompts,
uses seed + k (whatever --batch_size).

The original's spelling works too, with the same flags:
    printf 'First prompt\nSecond prompt\n' | python -m tfgpt2.interactive_conditional_samples
"""
import itertools
import sys

from ..decoding.request import check_window
from .common import FLAGS, end_at_once, load, print_batch, progress, sampling_parser

PROMPT_NAMES = dict(FLAGS, prompts="the prompt")  # the request's fields as the messages name them


def prompts():
    """(line number, text) for each non-empty prompt, until end of input."""
    tty = sys.stdin.isatty()
    for number in itertools.count(1):
        try:
            text = input("Model prompt >>> " if tty else "")
        except EOFError:
            if tty:
                print()
            return
        if text:
            yield number, text
        else:
            print("Prompt should not be empty!", file=sys.stdout if tty else sys.stderr)


def main(argv=None, prog="tfgpt2 interactive"):
    end_at_once()
    p = sampling_parser(prog, __doc__,
                     nsamples=1, nsamples_min=1, nsamples_help="samples per prompt (default 1)",
                     length_help="tokens per sample (default: half the model's n_ctx)")
    args = p.parse_args(argv)
    if args.nsamples % args.batch_size:
        p.error(f"--batch_size {args.batch_size} must divide --nsamples {args.nsamples}")
    model, enc, request = load(args, lambda n_ctx: n_ctx // 2)
    n_ctx = model.hparams.n_ctx
    batch = 0
    for number, prompt in prompts():
        context = enc.encode(prompt)
        try:
            check_window(len(context), request.length, n_ctx, context_keep=request.context_keep, names=PROMPT_NAMES)
        except ValueError as e:
            print(f"error: line {number}: {e}", file=sys.stderr)
            continue
        with progress(args, args.nsamples) as bar:
            for generated in range(0, args.nsamples, args.batch_size):
                print_batch(model, enc, args, request, context, batch, generated + 1, args.batch_size)
                bar.update(args.batch_size)
                batch += 1
        print("=" * 80, flush=True)
