"""Generate samples from nothing (after <|endoftext|>), as OpenAI's
`src/generate_unconditional_samples.py` does, with its flags and output:

    python -m tfgpt2.generate_unconditional_samples --model_name 124M --nsamples 4 --top_k 40

--nsamples 0 (the default) generates until interrupted (Ctrl-C); --length defaults to n_ctx. One
difference: the original adds batch_size to its count for every sample, so with
--batch_size 2 its banners read SAMPLE 2, 4, ... and it stops at half of --nsamples. Here
samples are numbered 1, 2, 3, ... and there are exactly --nsamples of them.
"""
from .common import end_at_once, load, parser, progress, sample_batch, show


def main(argv=None, prog="tfgpt2 generate"):
    end_at_once()
    args = parser(prog, __doc__,
                  nsamples=0, nsamples_min=0, nsamples_help="how many samples; 0 (default) generates forever",
                  length_help="tokens per sample (default: the model's n_ctx)").parse_args(argv)
    model, enc, length = load(args, lambda n_ctx: n_ctx)
    generated, batch = 0, 0
    with progress(args.nsamples or None) as bar:
        while args.nsamples == 0 or generated < args.nsamples:
            texts = sample_batch(model, enc, args, length, [enc.eot_token], batch)
            for text in texts[:args.nsamples - generated if args.nsamples else None]:
                generated += 1
                show(generated, text)
                bar.update()
            batch += 1
