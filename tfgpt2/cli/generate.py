"""Generate samples, as OpenAI's `src/generate_unconditional_samples.py` does, with its flags
and output; with --prompt, continuations of that text instead.

    tfgpt2 generate --model_name 124M --nsamples 4 --top_k 40
    tfgpt2 generate --prompt "The meaning of life is" --nsamples 2 --length 40 --seed 1
    tfgpt2 generate --model_dir checkpoint/run1 --nsamples 1 --temperature 0.7 | less
    tfgpt2 generate --litert gpt2-int8.tflite --prompt "The meaning of life is" --length 40

Without --prompt each sample starts from <|endoftext|> alone and --length defaults to n_ctx;
with --prompt it continues the prompt's tokens and --length defaults to half of n_ctx (as the
interactive command). --nsamples 0 (the default without --prompt, as the original) generates
until interrupted (Ctrl-C); with --prompt the default is 1. One
difference: the original adds batch_size to its count for every sample, so with
--batch_size 2 its banners read SAMPLE 2, 4, ... and it stops at half of --nsamples. Here
samples are numbered 1, 2, 3, ... and there are exactly --nsamples of them.

--litert FILE generates with a LiteRT file of `tfgpt2 export --format litert` on
ai_edge_litert, one prompt at a time (the file runs at batch 1), with the same sampling and
controls (not --context_keep: the file's cache holds n_ctx positions).

The original's spelling works too, with the same flags:
    python -m tfgpt2.generate_unconditional_samples --model_name 124M --nsamples 2 --top_k 40
"""
import sys

from ..decoding.request import check_window
from .common import FLAGS, end_at_once, load, load_litert, print_batch, progress, sampling_parser


def main(argv=None, prog="tfgpt2 generate"):
    end_at_once()
    p = sampling_parser(prog, __doc__,
                     nsamples=0, nsamples_min=0,
                     nsamples_help="how many samples; 0 generates forever (default: 0, or 1 with --prompt)",
                     length_help="tokens per sample (default: the model's n_ctx, or half of it with --prompt)")
    p.add_argument("--prompt", metavar="TEXT",
                   help="continue this text (default: samples from nothing, after <|endoftext|>)")
    p.add_argument("--litert", metavar="FILE", help="generate with this LiteRT file (tfgpt2 export --format litert)")
    p.set_defaults(nsamples=None)
    args = p.parse_args(argv)
    if args.nsamples is None:
        args.nsamples = 0 if args.prompt is None else 1
    if args.prompt == "":
        p.error("argument --prompt: the prompt is empty; leave --prompt out for samples from nothing")
    if args.litert and args.dtype != "float32":
        p.error("--dtype does not apply to --litert (the file's weights are as exported)")
    if args.litert and args.context_keep:
        p.error("--context_keep does not apply to --litert (the file's cache holds n_ctx positions)")
    model, enc, request = (load_litert if args.litert else load)(
        args, lambda n_ctx: n_ctx if args.prompt is None else n_ctx // 2)
    context = [enc.eot_token] if args.prompt is None else enc.encode(args.prompt)
    n_ctx = model.n_ctx if args.litert else model.hparams.n_ctx
    try:
        check_window(len(context), request.length, n_ctx, context_keep=request.context_keep, names=FLAGS)
    except ValueError as e:
        sys.exit(f"error: {e}")
    generated, batch = 0, 0
    with progress(args, args.nsamples or None) as bar:
        while args.nsamples == 0 or generated < args.nsamples:
            count = min(args.batch_size, args.nsamples - generated) if args.nsamples else args.batch_size
            print_batch(model, enc, args, request, context, batch, generated + 1, count)
            generated += count
            bar.update(count)
            batch += 1
