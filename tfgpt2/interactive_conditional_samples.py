"""`python -m tfgpt2.interactive_conditional_samples`: OpenAI's src/interactive_conditional_samples.py, as `tfgpt2 interactive` (`tfgpt2.cli`)."""
if __name__ == "__main__":
    from tfgpt2.cli.main import run_command
    run_command("interactive", prog="python -m tfgpt2.interactive_conditional_samples")
