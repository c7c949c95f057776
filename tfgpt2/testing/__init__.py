"""Checking tfgpt2 against OpenAI's original code: the reference run in a child process
(`reference`), the comparison (`compare`), and model folders of random weights in the original
layout (`checkpoints`)."""
