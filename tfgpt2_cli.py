"""The `tfgpt2` console script (`[project.scripts]`): `tfgpt2.cli.main`, with TensorFlow's
start-up lines kept off the terminal.

TensorFlow writes its start-up notices (absl's "All log messages before absl::InitializeLog()",
cudart_stub, cpu_feature_guard, ...) from C++ straight to file descriptor 2 while it is
imported, before any flag could be read. So this module, outside the package (whose import
loads TensorFlow), sets TF_CPP_MIN_LOG_LEVEL=3 unless the user set it, points descriptor 2 at
/dev/null while it imports TensorFlow and tfgpt2, then puts it back: warnings and errors after
start-up still show. A failed import is reported as usual once stderr is back.
"""
import os
import sys


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    _import_quietly()
    from tfgpt2.cli.main import main as run
    return run()


def _import_quietly():
    """Import tensorflow and tfgpt2 with descriptor 2 on /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        import tensorflow  # noqa: F401
        import tfgpt2  # noqa: F401  (registers tfgpt2's Keras classes)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


if __name__ == "__main__":
    sys.exit(main())
