"""Mean loss, perplexity and bits per byte of a model over a text, as language-model
evaluations report them.

    tfgpt2 evaluate --model_name 124M --dataset wiki.test.raw --stride 512
    tfgpt2 evaluate --model_dir checkpoint/run1 --dataset valid.txt --quiet
    tfgpt2 encode valid.txt valid.npz && tfgpt2 evaluate --dataset valid.npz

The text is encoded after an `<|endoftext|>` (so its first token is scored too) and read in
windows of n_ctx tokens that start `--stride` tokens apart: each token is scored once, by the
first window that predicts it, with up to n_ctx - stride tokens of context before it. An
.npz of `tfgpt2 encode` is read as its texts: each chunk after an `<|endoftext|>`.
Progress: a line on stderr for each stage (reading, loading, scoring so many windows);
the result is one line on stdout.
"""
import argparse
import math
import sys

from .args import Parser, ranged
from .common import add_model_flags, add_text_flags, add_tf32, encoder_of, model_dir, parse


def main(argv=None, prog="tfgpt2 evaluate"):
    p = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help="a text file, or an .npz of `tfgpt2 encode`")
    add_model_flags(p)
    p.add_argument("--stride", type=ranged(int, 1), help="tokens between window starts (default n_ctx: no overlap)")
    p.add_argument("--batch_size", type=ranged(int, 1), default=1,
                   help="windows at once (their logits take batch x n_ctx x 50257 floats: 206 MB each for 1024)")
    add_tf32(p)
    add_text_flags(p, "the text file's")
    args, progress = parse(p, argv)
    from ..formats.checkpoint import load_model
    from ..hparams import load_hparams
    from ..train import data
    from ..train.perplexity import evaluate, windows
    try:
        folder = model_dir(args)
        progress.note(f"reading and encoding {args.dataset}")
        tokens, n_bytes = data.scored_tokens(encoder_of(folder), args.dataset, encoding=args.encoding,
                                             n_vocab=load_hparams(folder).n_vocab)
        progress.note(f"loading {folder}")
        model = load_model(folder, tf32=args.tf32)
        n_ctx = model.hparams.n_ctx
        count = len(windows(len(tokens), n_ctx, args.stride or n_ctx))
        progress.note(f"scoring {len(tokens) - 1} tokens in {count} windows of up to {n_ctx} tokens, "
                      f"{args.batch_size} at a time")
        result = evaluate(model, tokens, stride=args.stride, n_bytes=n_bytes,
                          batch_size=args.batch_size)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    if not math.isfinite(result["loss"]):
        sys.exit(f"error: the loss of {folder} over {args.dataset} is {result['loss']}: the model's outputs "
                 "overflow (weights too large?)")
    progress.note(f"done in {progress.seconds():.1f} s")
    print(f"tokens {result['tokens']}  loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  "
          f"bits per byte {result['bits_per_byte']:.4f}")
