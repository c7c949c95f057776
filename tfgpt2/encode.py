"""`python -m tfgpt2.encode`: the forks' encode.py, as `tfgpt2 encode` (tfgpt2/cli/encode.py)."""
if __name__ == "__main__":
    from tfgpt2.cli.main import run_command
    run_command("encode", prog="python -m tfgpt2.encode")
