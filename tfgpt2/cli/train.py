"""`tfgpt2 train` (and `python -m tfgpt2.train`): fine-tuning with the forks' flags."""
import argparse
import dataclasses
import os
import sys

from ..train import distribute, loop
from ..train.config import TrainConfig
from ..train.step import prefer_memory_schedule
from .args import Parser

EXAMPLES = """examples:
    tfgpt2 train --dataset corpus.txt --model_name 124M --steps 1000 --run_name run1
    tfgpt2 encode corpus/ corpus.npz && tfgpt2 train --dataset corpus.npz --steps 500 --sample_every 100
    tfgpt2 train --dataset corpus.txt --steps 2000 --restore_from latest   # continue run1 exactly
    tfgpt2 train --dataset corpus.txt --model_name 774M --lora_rank 8 --remat --run_name lora1
    tfgpt2 generate --model_dir checkpoint/run1 --prompt "Once upon a time" --nsamples 1

Progress: a bar on a terminal, else a line every --print_every steps, on stderr; --quiet
leaves warnings, errors and the final line. The original's spelling works too:
    python -m tfgpt2.train --dataset corpus.txt --model_name 124M
"""


def training_parser(prog="tfgpt2 train"):
    """A flag for each setting of `TrainConfig`, with its help; the flags give text, which the
    config reads and checks (a flag not given is left out, for the config's default)."""
    p = Parser(prog=prog, description=loop.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               argument_default=argparse.SUPPRESS, epilog=EXAMPLES)
    for field in dataclasses.fields(TrainConfig):
        rule = field.metadata
        options = dict(help=rule["help"], required=field.default is dataclasses.MISSING)
        if rule["kind"] is bool:
            options["action"] = "store_true"
        elif rule["kind"] is list:
            options.update(nargs="+", metavar=rule["metavar"])
        elif rule.get("choices"):
            options["choices"] = rule["choices"]
        p.add_argument(f"--{field.name}", *(f"--{alias}" for alias in rule.get("aliases", ())), dest=field.name,
                       **options)
    return p


def parse_config(argv, prog="tfgpt2 train"):
    """The TrainConfig of the flags; a bad one exits with a one-line usage error."""
    p = training_parser(prog)
    try:
        return TrainConfig(**vars(p.parse_args(argv)))
    except ValueError as e:
        p.error(str(e))


def main(argv=None, prog="tfgpt2 train"):
    import tensorflow as tf
    from ..train.run_folder import checkpoint_steps
    config = parse_config(sys.argv[1:] if argv is None else list(argv), prog)
    if config.remat:  # a process of its own: XLA's scheduler told to keep what --remat frees
        prefer_memory_schedule()
    try:
        loop.train(config)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    except tf.errors.OpError as e:  # a worker that died, memory, ...
        print(distribute.failure(e, config.run_dir, checkpoint_steps(config.run_dir)), file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: TensorFlow's teardown can abort after a failed collective
    except KeyboardInterrupt:
        sys.exit(130)
