"""`python -m tfgpt2.params`: as `tfgpt2 params` (tfgpt2/cli/params.py)."""
if __name__ == "__main__":
    from tfgpt2.cli.main import run_command
    run_command("params", prog="python -m tfgpt2.params")
