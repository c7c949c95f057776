"""The one range checker: a number's kind and bounds (`Range`), the message that names a value
outside them (quoting it as `shown` does), and `Range.check`, which every entry point asks (the request rules of
`decoding.request`, the commands' flags, `train.config`'s settings). Imports nothing of
TensorFlow: a command checks its flags before TensorFlow loads."""
import dataclasses
import math
import numbers
import reprlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class Range:
    """Numbers of `kind` (int or float) from `low` to `high`: an int range holds both ends, a
    float one the ends that `ends` brackets ("[]", "[)", "()"); a float range open at inf holds
    finite numbers only. `holds` takes Python numbers, NumPy arrays and tensors alike (NaN never
    holds)."""
    kind: type
    low: float = -math.inf
    high: float = math.inf
    ends: str = "[]"

    def holds(self, x):
        if getattr(getattr(x, "dtype", None), "is_integer", False):  # an int tensor (NumPy's dtypes have no such field)
            import tensorflow as tf
            x = tf.cast(x, tf.int64)
        above = x >= self.low if self.ends[0] == "[" else x > self.low
        below = x <= self.high if self.ends[1] == "]" else x < self.high
        return above & below

    def check(self, value, name=None, *, text=False):
        """`value` as the int or float this range holds, else ValueError: "{name} must be
        {self}, got {value}" ("must be ..." without a name). Bools are refused, and strings
        unless `text` (a flag's text, read as a number first)."""
        number = _number(self.kind, value, text)
        try:
            ok = number is not None and bool(self.holds(number))
        except OverflowError:  # a float beyond float64
            ok = False
        if not ok:
            raise ValueError(f"{name + ' ' if name else ''}must be {self}, got {shown(value)}")
        return number

    def __str__(self):
        if self.kind is int:
            if self.high == math.inf:
                return f"an integer >= {_bound(self.low)}"
            return f"an integer in [{_bound(self.low)}, {_bound(self.high + 1)})"
        if self.high == math.inf and self.low == -math.inf:
            return "a number < inf"
        if self.high == math.inf:
            return f"a finite number {'>=' if self.ends[0] == '[' else '>'} {_bound(self.low)}"
        return f"a number in {self.ends[0]}{_bound(self.low)}, {_bound(self.high)}{self.ends[1]}"


def shown(value, limit=40):
    """`value` as an error message quotes it: a number as text, anything else as its repr, at
    most about `limit` characters (a 4000-digit number, a long string or a list of a million
    prompts is cut, not echoed whole)."""
    if isinstance(value, numbers.Number):
        text = str(value)
        return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-(limit // 2):]}"
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = limit
    short.maxlevel, short.maxlist, short.maxdict, short.maxtuple = 2, 4, 4, 4
    return short.repr(value)


def _number(kind, value, text):
    """`value` as a `kind`, or None where it is not one (a bool, a string unless `text`, a float
    for an int range)."""
    if isinstance(value, str) and text:
        try:
            return kind(value)
        except ValueError:
            return None
    exact = numbers.Integral if kind is int else numbers.Real
    if not isinstance(value, exact) or isinstance(value, (bool, np.bool_)):
        return None
    try:
        return kind(value)
    except OverflowError:
        return None


def _bound(n):
    """n as a range shows it: 2**31 for a power of two from 2**16, 0.5 for a float."""
    if float(n).is_integer() and n >= 2**16 and int(n) & (int(n) - 1) == 0:
        return f"2**{int(n).bit_length() - 1}"
    return str(int(n)) if float(n).is_integer() else f"{n:g}"
