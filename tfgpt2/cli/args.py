"""argparse as every command uses it: one-line usage errors, and numbers checked for range."""
import argparse
import math


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (naming the flag and the value) instead of
    the usage text before it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def ranged(kind, low, high=None):
    """An argparse type: a finite `kind` (int or float) from `low` to `high` (no limit if None)."""
    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (high is not None and value > high):
            what = "an integer" if kind is int else "a number"
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {what} {bounds}, got {text!r}")
        return value
    return convert
