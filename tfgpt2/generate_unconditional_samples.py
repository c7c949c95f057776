"""`python -m tfgpt2.generate_unconditional_samples`: OpenAI's script, as `tfgpt2 generate` (tfgpt2/cli/generate.py)."""
if __name__ == "__main__":
    from tfgpt2.cli.main import run_command
    run_command("generate", prog="python -m tfgpt2.generate_unconditional_samples")
