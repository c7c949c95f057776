"""`tfgpt2 <command> ...`: every command a user runs, one module each in this folder.

The `tfgpt2` console script is `tfgpt2_cli.main` (a top-level module beside the package): it
hides TensorFlow's start-up lines while it imports TensorFlow and tfgpt2, then calls `main`
here; `python -m tfgpt2` (tfgpt2/__main__.py) calls it too. `run_command` also serves the `python -m`
names of OpenAI's sample scripts and the forks' train.py."""
import importlib
import os
import sys

# name: its line in `tfgpt2 --help` (its code: the module `module_name(name)`)
COMMANDS = {
    "download": "fetch one of OpenAI's checkpoints (124M, 355M, 774M, 1558M) into models/",
    "make-checkpoint": "write random weights in the original layout, for offline use",
    "generate": "sample text, as OpenAI's generate_unconditional_samples.py (--prompt to continue one)",
    "interactive": "continue prompts typed or piped in, as interactive_conditional_samples.py",
    "generate-batch": "continue every prompt of a JSONL file, resumable, over several workers",
    "train": "fine-tune on your text with the forks' train.py flags (run folders, resume)",
    "evaluate": "loss, perplexity and bits per byte of a model over a text",
    "encode": "pre-encode a corpus into an .npz of token chunks, as the forks' encode.py",
    "export": "export a SavedModel for TensorFlow Serving (logits and XLA generation)",
    "convert": "convert weights between OpenAI's, Hugging Face's and KerasHub's layouts",
    "compare": "run OpenAI's original code beside tfgpt2 and show where they differ",
    "params": "parameter counts, part by part",
    "serve": "an OpenAI-compatible completions server with continuous batching (/v1/completions)",
}


def module_name(command):
    return "tfgpt2.cli." + command.replace("-", "_")


def quiet():
    """What a command sets for its own process: TensorFlow's C++ notices off (unless the user set
    TF_CPP_MIN_LOG_LEVEL); `tfgpt2.decoding` keeps generation's retracing warnings off."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def usage(prog="tfgpt2"):
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help}" for name, help in COMMANDS.items()]
    return (f"usage: {prog} <command> [options]   ({prog} <command> --help for its options and examples)\n\n"
            "OpenAI's GPT-2 in TensorFlow 2 / Keras 3.\n\ncommands:\n" + "\n".join(lines) + "\n\n"
            "Every command takes --quiet (no progress on stderr, only results and errors).\n"
            "For example:\n"
            "  tfgpt2 download 124M\n"
            "  tfgpt2 generate --model_name 124M --prompt \"Hello, my name is\" --nsamples 2 --length 40\n"
            "  tfgpt2 train --dataset corpus.txt --model_name 124M --steps 1000\n")


def run_command(name, argv=None, *, prog=None):
    """Run command `name` on `argv` (default: the process's arguments) and exit with its status;
    Ctrl-C ends it with a line and status 130, the shell's for an interrupted command (what a
    command writes is complete or not there: `formats.files`)."""
    quiet()
    prog = prog or f"tfgpt2 {name}"
    try:
        module = importlib.import_module(module_name(name))
        status = module.main(sys.argv[1:] if argv is None else argv, prog=prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        status = 130
    sys.exit(status)


def main(argv=None, prog="tfgpt2"):
    """`prog <command> ...` (`prog`: how the user called it, for usage lines)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["help"] and argv[1:2] and argv[1] in COMMANDS:  # tfgpt2 help <command>
        argv = [argv[1], "--help"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        (sys.stdout if argv else sys.stderr).write(usage(prog))
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import version
        print(f"tfgpt2 {version('tfgpt2')}")
        return 0
    if argv[0] not in COMMANDS:
        sys.stderr.write(f"{prog}: unknown command {argv[0]!r}\n\n" + usage(prog))
        return 2
    run_command(argv[0], argv[1:], prog=f"{prog} {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
