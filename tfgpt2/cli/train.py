"""`tfgpt2 train` (and `python -m tfgpt2.train`): fine-tuning with the forks' flags."""
import os
import sys

from ..train import distribute
from ..train.flags import parse_args, run


def main(argv=None, prog="tfgpt2 train"):
    import tensorflow as tf
    from ..train.run_folder import checkpoint_steps
    args = parse_args(argv, prog=prog)
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
