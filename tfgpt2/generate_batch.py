"""`python -m tfgpt2.generate_batch`: as `tfgpt2 generate-batch` (tfgpt2/cli/generate_batch.py)."""
if __name__ == "__main__":
    from tfgpt2.cli.main import run_command
    run_command("generate-batch", prog="python -m tfgpt2.generate_batch")
