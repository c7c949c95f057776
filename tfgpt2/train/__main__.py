"""`python -m tfgpt2.train`: the forks' train.py, as `tfgpt2 train` (tfgpt2/cli/train.py)."""
from tfgpt2.cli.main import run_command

run_command("train", prog="python -m tfgpt2.train")
