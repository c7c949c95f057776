"""argparse as every command uses it: one-line usage errors, and numbers checked for range."""
import argparse
import math

from ..ranges import Range


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (naming the flag and the value) instead of
    the usage text before it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def ranged(kind, low, high=None, *, above=False):
    """An argparse type: a finite `kind` (int or float) from `low` (or, `above`, more than it)
    to `high` (no limit if None), checked by the one range rule (`ranges.Range`)."""
    return checked_range(Range(kind, low, math.inf if high is None else high,
                               ("(" if above else "[") + ("]" if high is not None or kind is int else ")")))


def checked_range(value_range):
    """An argparse type: a number of `value_range` (`ranges.Range`), read from the flag's text."""
    return checked(lambda text: value_range.check(text, text=True))


def token_value(text):
    """An argparse type: ID=VALUE, a token id and a number (-inf allowed), as (id, value); their
    ranges are the request rules' (`decoding.request`)."""
    token, _, value = text.partition("=")
    try:
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be TOKEN_ID=VALUE (a token id, a number or -inf), got {text!r}") \
            from None


def checked(check):
    """An argparse type: the text as `check(text)` returns it; its ValueError is the usage error."""
    def convert(text):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert
