"""The forks' `train.py` flags (and more), and `finetune`, which takes them as keywords."""
import argparse
import os

from ..cli.args import Parser, ranged
from ..model import LORA_TARGETS
from . import distribute
from .optimizers import OPTIMIZERS


def parser(prog="tfgpt2 train"):
    from . import loop  # its docstring is the description
    p = Parser(prog=prog, description=loop.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--dataset", required=True, help="a text file, a folder, a glob, or an .npz of encoded chunks")
    a("--model_name", default="124M", help="the model to start from: <models_dir>/<model_name>")
    a("--models_dir", default="models")
    a("--combine", type=ranged(int, 1), default=50000,
      help="join text files with <|endoftext|> until at least this many characters per chunk")
    a("--encoding", default="utf-8", help="the text files' encoding")
    a("--batch_size", type=ranged(int, 1), default=1,
      help="windows per micro-batch in all, split over the replicas of --strategy")
    a("--strategy", choices=distribute.STRATEGIES, default="auto",
      help="auto: several GPUs -> mirrored, TF_CONFIG -> multiworker, else one (see tfgpt2/train/distribute.py)")
    a("--tpu", help="with --strategy tpu: the TPU's name or grpc:// address (empty on a TPU VM)")
    a("--learning_rate", type=ranged(float, 0), default=2e-5)
    a("--optimizer", choices=OPTIMIZERS, default="adam")
    a("--accumulate_gradients", type=ranged(int, 1), default=1,
      help="micro-batches per update, their gradients averaged")
    a("--only_train_transformer_layers", action="store_true", help="train the blocks only (not wte, wpe, ln_f)")
    a("--steps", type=ranged(int, -1), default=-1,
      help="stop when the run has made this many updates in all (-1: never); rerun the same "
           "command with --restore_from latest to continue an interrupted run exactly")
    a("--run_name", default="run1")
    a("--checkpoint_dir", default="checkpoint")
    a("--restore_from", default="latest",
      help="latest (the run folder's latest checkpoint, else the base model), fresh (the base "
           "model), or a model folder / checkpoint prefix (its weights, from step 0)")
    a("--save_every", type=ranged(int, 0), default=1000)
    a("--max_checkpoints", type=ranged(int, 1), default=1)
    a("--sample_every", type=ranged(int, 0), default=100)
    a("--sample_length", type=ranged(int, 1), default=None,
      help="tokens per sample, and the tokens a training window predicts "
           "(a window is sample_length + 1 tokens); default n_ctx - 1 (1023), the forks'")
    a("--sample_num", type=ranged(int, 1), default=1)
    a("--top_k", type=ranged(int, 0), default=40)
    a("--val_dataset", help="validation data; without it, the last --val_fraction of --dataset is held out")
    a("--val_fraction", type=ranged(float, 0, 1), default=0.1)
    a("--val_every", type=ranged(int, 0), default=0)
    a("--val_batch_size", type=ranged(int, 1), default=2)
    a("--val_batch_count", type=ranged(int, 1), default=40)
    a("--print_every", type=ranged(int, 0), default=1,
      help="a line every this many steps where stderr is not a terminal (a terminal has a bar); 0: none")
    a("--quiet", action="store_true", help="no bar or per-step lines, samples or checkpoint messages: "
                                            "warnings, errors and the final line only")
    a("--no_xla", action="store_true", help="run the step without XLA (compiles faster; on a CPU, 16-bit products: see --precision)")
    a("--seed", type=int, default=0, help="draws the windows (and samples)")
    a("--lr_schedule", choices=("constant", "cosine"), default="constant",
      help="cosine: down to a tenth of --learning_rate at --steps")
    a("--warmup_steps", type=ranged(int, 0), default=0)
    a("--clip_norm", type=ranged(float, 0), default=0.0, help="clip gradients to this global norm (0: off)")
    a("--weight_decay", type=ranged(float, 0), default=0.0,
      help="decoupled weight decay (AdamW's), not of biases or norm gains; with --optimizer adamw, "
           "0 means Keras' default, 0.004")
    a("--precision", choices=("float32", "mixed_bfloat16", "mixed_float16"), default="float32",
      help="mixed_*: float32 weights, matmuls in 16 bits (float16 with dynamic loss scaling); "
           "on a CPU only with --no_xla (XLA's CPU dots are float32), faster where oneDNN's "
           "bfloat16 kernels are")
    a("--remat", action="store_true", help="recompute each block in the backward pass: less memory, more time")
    a("--lora_rank", type=ranged(int, 1), default=None,
      help="train LoRA adapters of this rank only (every other weight frozen); model-<step> holds the "
           "merged weights, lora-<step> the adapters")
    a("--lora_alpha", type=ranged(float, 0), default=None, help="the adapters' scale is lora_alpha / lora_rank "
                                                                "(default lora_rank: a scale of 1, as Keras')")
    a("--lora_targets", nargs="+", default=None, metavar="NAME",
      help=f"the Conv1D layers to adapt in every block (default {' '.join(LORA_TARGETS)}): c_attn, c_proj, "
           "c_fc, attn/c_proj, mlp/c_proj")
    return p


def parse_args(argv=None, *, exit_on_error=True, prog="tfgpt2 train"):
    """The flags; a bad one exits with a one-line usage error, or with `exit_on_error`
    False raises ValueError with it."""
    p = parser(prog)
    if not exit_on_error:
        p.error = _raise
    args = p.parse_args(argv)
    if args.lr_schedule == "cosine" and args.steps < 1:
        p.error("--lr_schedule cosine needs --steps")
    if (args.lora_alpha is not None or args.lora_targets) and not args.lora_rank:
        p.error("--lora_alpha and --lora_targets need --lora_rank")
    return args


def _raise(message):
    raise ValueError(message)


def finetune(dataset, *, strategy=None, **flags):
    """`python -m tfgpt2.train` from Python, as gpt-2-simple's `finetune` for notebooks: each
    keyword is the flag of that name (True for a switch), e.g.
    `finetune("corpus.txt", model_name="355M", steps=1000, remat=True)` (a list for a flag of
    several values: `lora_rank=8, lora_targets=["c_attn", "c_fc"]`). Returns the (step,
    loss) of each update; Ctrl-C (an interrupted cell) saves and returns. A bad flag raises
    ValueError before anything is loaded or written. With `remat=True` on a CPU, calling
    `prefer_memory_schedule()` first (before anything compiles) keeps XLA from undoing the
    saving; it sets a process-wide flag, so it is yours to call (`tfgpt2 train --remat` does)."""
    argv = ["--dataset", str(dataset)]
    for name, value in flags.items():
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, (list, tuple)):
            argv += [f"--{name}", *map(str, value)]
        elif value is not None and value is not False:
            argv += [f"--{name}", str(value)]
    return run(parse_args(argv, exit_on_error=False), strategy)


def run(args, strategy=None):
    """`train` in the strategy of --strategy unless given one."""
    from .loop import train
    return train(args, strategy or distribute.make_strategy(args.strategy, args.tpu))


def prefer_memory_schedule():
    """Ask XLA's CPU scheduler for its memory-minimizing order. By default it orders for
    concurrency and keeps alive the activations that `--remat` frees. A process-wide flag
    (`XLA_FLAGS`), read at the first XLA compilation: set before any, or it does nothing."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_enable_concurrency_optimized_scheduler=false".strip()
