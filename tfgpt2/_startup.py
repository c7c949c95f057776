"""TensorFlow's start-up lines kept off the terminal when tfgpt2 runs as a command.

TensorFlow writes its start-up notices (absl's "All log messages before absl::InitializeLog()",
cudart_stub, cpu_feature_guard, ...) from C++ straight to file descriptor 2 while it is
imported, before any flag could be read. Started as a command (the `tfgpt2` script, `python -m
tfgpt2 ...`, `python -m tfgpt2.train` and the original scripts' names), the package sets
TF_CPP_MIN_LOG_LEVEL=3 unless the user set it and imports TensorFlow with descriptor 2 on
/dev/null, then puts it back: warnings and errors after start-up still show, and a failed import
is reported as usual once stderr is back. A command also starts without matplotlib, which Keras
imports as it starts for plots no command draws (`without_plots`). Imported by a program of its
own, the package leaves stderr and matplotlib alone. Standard library only: it runs before
TensorFlow is imported.
"""
import contextlib
import os
import sys


def as_command():
    """Whether this process is tfgpt2 started as a command: `python -m tfgpt2...` (whose package
    import runs while sys.argv[0] is "-m"), or the console script (`tfgpt2_cli`, imported or run)."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    return sys.argv[:1] == ["-m"] or "tfgpt2_cli" in sys.modules or getattr(main, "name", None) == "tfgpt2_cli"


@contextlib.contextmanager
def quietly(quiet):
    """Descriptor 2 on /dev/null inside the block where `quiet`, TF_CPP_MIN_LOG_LEVEL 3 by default."""
    if not quiet:
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def without_plots(command):
    """Where `command`, matplotlib cannot be imported inside the block: Keras imports
    matplotlib.pyplot as TensorFlow starts (0.6 s, a sixth of a command's start) and, where that
    fails, leaves its plotting functions unavailable. After the block it imports as usual."""
    if not command or "matplotlib" in sys.modules:
        yield
        return
    sys.modules["matplotlib"] = None  # an import of it raises ImportError
    try:
        yield
    finally:
        if sys.modules.get("matplotlib", False) is None:
            del sys.modules["matplotlib"]
