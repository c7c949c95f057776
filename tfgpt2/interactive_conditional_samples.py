"""`python -m tfgpt2.interactive_conditional_samples`: OpenAI's script, as `tfgpt2 interactive` (cli/interactive.py)."""
if __name__ == "__main__":
    from tfgpt2.cli.main import run_command
    run_command("interactive", prog="python -m tfgpt2.interactive_conditional_samples")
