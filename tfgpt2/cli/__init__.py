"""The `tfgpt2` command (`main`): one module per subcommand, each with `main(argv, prog)`."""
