"""`python -m tfgpt2 <command> ...`: the `tfgpt2` command (tfgpt2/cli/main.py) where its console
script is not on the PATH. OpenAI's two sample scripts keep their own names beside this file, as
in the original's src/ (`python -m tfgpt2.generate_unconditional_samples`, `python -m
tfgpt2.interactive_conditional_samples`), and the forks' train.py is `python -m tfgpt2.train`."""
import sys

if __name__ == "__main__":
    from tfgpt2.cli.main import main
    sys.exit(main(prog="python -m tfgpt2"))
