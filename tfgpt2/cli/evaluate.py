"""Mean loss, perplexity and bits per byte of a model over a text, as language-model
evaluations report them.

    tfgpt2 evaluate --model_name 124M --dataset wiki.test.raw --stride 512
    tfgpt2 evaluate --model_dir checkpoint/run1 --dataset valid.txt

The text is encoded after an `<|endoftext|>` (so its first token is scored too) and read in
windows of n_ctx tokens that start `--stride` tokens apart: each token is scored once, by the
first window that predicts it, with up to n_ctx - stride tokens of context before it.
"""
import argparse
import os
import sys


def main(argv=None, prog="tfgpt2 evaluate"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help="a text file")
    p.add_argument("--model_name", default="124M")
    p.add_argument("--models_dir", default="models")
    p.add_argument("--model_dir", help="a model or run folder (instead of --models_dir/--model_name)")
    p.add_argument("--stride", type=int, help="tokens between window starts (default n_ctx: no overlap)")
    p.add_argument("--batch_size", type=int, default=1,
                   help="windows at once (their logits take batch x n_ctx x 50257 floats: 206 MB each for 1024)")
    p.add_argument("--encoding", default="utf-8", help="the text file's encoding")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch_size must be >= 1, got {args.batch_size}")
    model_dir = args.model_dir or os.path.join(args.models_dir, args.model_name)
    from ..encoder import get_encoder
    from ..formats.checkpoint import load_model
    from ..train import data
    from ..train.evaluate import evaluate
    try:
        text = data.read_text(args.dataset, args.encoding)
        enc = get_encoder(os.path.basename(os.path.normpath(model_dir)), os.path.dirname(os.path.normpath(model_dir)))
        tokens = [enc.eot_token] + enc.encode(text)
        if len(tokens) < 2:
            raise ValueError(f"{args.dataset}: no text to evaluate")
        model = load_model(model_dir)
        result = evaluate(model, tokens, stride=args.stride, n_bytes=len(text.encode("utf-8")),
                          batch_size=args.batch_size)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"tokens {result['tokens']}  loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  "
          f"bits per byte {result['bits_per_byte']:.4f}")
