"""`python -m tfgpt2.evaluate`: as `tfgpt2 evaluate` (tfgpt2/cli/evaluate.py)."""
if __name__ == "__main__":
    from tfgpt2.cli.main import run_command
    run_command("evaluate", prog="python -m tfgpt2.evaluate")
