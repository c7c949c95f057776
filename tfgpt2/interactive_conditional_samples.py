"""Continue prompts, as OpenAI's `src/interactive_conditional_samples.py` does, with its
flags and output:

    python -m tfgpt2.interactive_conditional_samples --model_name 124M --top_k 40
    printf 'First prompt\nSecond prompt\n' | python -m tfgpt2.interactive_conditional_samples

On a terminal it asks "Model prompt >>> "; otherwise it reads one prompt per line of stdin,
without asking, and says "Prompt should not be empty!" on stderr. It ends at end of input
(Ctrl-D) with status 0. Each prompt gets --nsamples samples (default 1; --batch_size must
divide it) of --length tokens (default n_ctx // 2), then a line of 80 "=". With --seed, a
run repeats exactly: batch b of the run, counted over all prompts, uses seed + b.
"""
import sys

from ._cli import load, parser, progress, run, sample_batch, show


def prompts():
    """The non-empty prompts, until end of input."""
    tty = sys.stdin.isatty()
    while True:
        try:
            text = input("Model prompt >>> " if tty else "")
        except EOFError:
            if tty:
                print()
            return
        if text:
            yield text
        else:
            print("Prompt should not be empty!", file=sys.stdout if tty else sys.stderr)


def main(argv=None):
    p = parser("tfgpt2.interactive_conditional_samples", __doc__,
               nsamples=1, nsamples_help="samples per prompt (default 1)",
               length_help="tokens per sample (default: half the model's n_ctx)")
    args = p.parse_args(argv)
    if args.nsamples % args.batch_size:
        p.error("--batch_size must divide --nsamples")
    model, enc, length = load(args, lambda n_ctx: n_ctx // 2)
    batch = 0
    for prompt in prompts():
        context = enc.encode(prompt)
        generated = 0
        with progress(args.nsamples) as bar:
            try:
                for _ in range(args.nsamples // args.batch_size):
                    for text in sample_batch(model, enc, args, length, context, batch):
                        generated += 1
                        show(generated, text)
                    bar.update(args.batch_size)
                    batch += 1
            except ValueError as e:  # the prompt is too long for --length more tokens
                print(f"error: {e}", file=sys.stderr)
        print("=" * 80, flush=True)


if __name__ == "__main__":
    run(main)
