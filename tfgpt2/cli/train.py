"""`tfgpt2 train` (and `python -m tfgpt2.train`): fine-tuning with the forks' flags."""
import os
import sys

from ..train import distribute
from ..train.flags import parse_args, parser, prefer_memory_schedule, run

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


def main(argv=None, prog="tfgpt2 train"):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        p = parser(prog)
        p.epilog = EXAMPLES
        p.print_help()
        return 0
    import tensorflow as tf
    from ..train.run_folder import checkpoint_steps
    args = parse_args(argv, prog=prog)
    if args.remat:  # a process of its own: XLA's scheduler told to keep what --remat frees
        prefer_memory_schedule()
    try:
        run(args)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    except tf.errors.OpError as e:  # a worker that died, memory, ...
        run_dir = os.path.join(args.checkpoint_dir, args.run_name)
        print(distribute.failure(e, run_dir, checkpoint_steps(run_dir)), file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: TensorFlow's teardown can abort after a failed collective
    except KeyboardInterrupt:
        sys.exit(130)
