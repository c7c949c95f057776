"""The JSONL plan of bulk generation: each line read and checked, and the batches to generate.

Each input line is a JSON object with a "prompt" (text; other keys are ignored, blank lines
skipped), and, optionally, generation controls of its own (`FIELDS`) over the command's flags.

Batches: prompts are grouped by the generator's length bucket (`decoding.plan.bucket` of
their token count) and their controls, and cut, in line order, into batches of `batch_size`;
a line with its own "seed" is a batch alone. Batch b of the plan (counted from 0, in the
order of the controls, then smallest bucket first) samples with seed + b. The plan depends
only on the input and `batch_size`, so a rerun, a resumed run and any number of workers give
each line the same text.
"""
import io
import json
import math

from ..decoding.plan import bucket, fits


def _number(value, low=-math.inf, high=math.inf, *, above=False):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if above else value >= low) and value <= high)


def _integer(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


FIELDS = {  # a line's control: (what its value must be, the check, given n_vocab)
    "temperature": ("a number >= 0", lambda v, _: _number(v, 0)),
    "top_k": ("an integer >= 0", lambda v, _: _integer(v, 0, 2**31 - 1)),
    "top_p": ("a number in [0, 1]", lambda v, _: _number(v, 0, 1)),
    "min_p": ("a number in [0, 1]", lambda v, _: _number(v, 0, 1)),
    "seed": ("an integer in [0, 2**32)", lambda v, _: _integer(v, 0, 2**32 - 1)),
    "repetition_penalty": ("a number > 0", lambda v, _: _number(v, 0, above=True)),
    "presence_penalty": ("a number >= 0", lambda v, _: _number(v, 0)),
    "frequency_penalty": ("a number >= 0", lambda v, _: _number(v, 0)),
    "stop_at_eot": ("true or false", lambda v, _: isinstance(v, bool)),
    "stop": ("a list of non-empty strings", lambda v, _: isinstance(v, list) and all(isinstance(t, str) and t
                                                                                    for t in v)),
    "logit_bias": ("an object of token ids below n_vocab to numbers (-100 or less bans)",
                   lambda v, n_vocab: isinstance(v, dict) and all(
                       k.isdigit() and int(k) < n_vocab and (_number(x) or x == -math.inf) for k, x in v.items())),
}


def line_controls(row, n_vocab):
    """The control fields of an input line (`FIELDS`), checked, as sorted (field, value) pairs:
    lines with equal pairs may share a batch. Raises ValueError naming the field."""
    fields = []
    for name in sorted(set(row) & set(FIELDS)):
        what, ok = FIELDS[name]
        if not ok(row[name], n_vocab):
            raise ValueError(f"field {name!r} must be {what}, got {json.dumps(row[name])}")
        value = row[name]
        if name == "logit_bias":
            value = tuple(sorted((int(k), float(x)) for k, x in value.items()))
        fields.append((name, tuple(value) if name == "stop" else value))
    return tuple(fields)


def line_keywords(fields, enc):
    """A line's controls (`line_controls`) as `tfgpt2.generate`'s keywords (logit_bias a dict,
    stop as token lists), to put over the command's."""
    keywords = dict(fields)
    if "logit_bias" in keywords:
        keywords["logit_bias"] = dict(keywords["logit_bias"])
    if "stop" in keywords:
        keywords["stop"] = [enc.encode(text) for text in keywords["stop"]]
    return keywords


def read_prompts(stream):
    """(line number, the line's object) for every non-blank line of a JSONL file, given as a
    binary stream; a line that is not UTF-8, or not a JSON object with a string "prompt",
    gives (line number, ValueError)."""
    for n, raw in enumerate(io.TextIOWrapper(stream, encoding="utf-8", errors="surrogateescape")):
        if not raw.strip():
            continue
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as e:  # a byte that is not UTF-8, kept as a lone surrogate
            at = len(raw[:e.start].encode("utf-8", "surrogateescape"))
            yield n, ValueError(f"not UTF-8: byte 0x{ord(raw[e.start]) - 0xDC00:02x} at byte {at} of the line")
            continue
        try:
            row = json.loads(raw.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            yield n, ValueError(f"not valid JSON ({e})")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            yield n, ValueError('not a JSON object with a string "prompt"')
        else:
            yield n, row


def problem(row, tokens, *, n_ctx, length, n_vocab, context_keep):
    """What is wrong with a line (`read_prompts`' object or error, and the prompt's tokens),
    as text, or its controls (`line_controls`) where nothing is."""
    if isinstance(row, ValueError):
        return str(row), None
    if not tokens:
        return "empty prompt", None
    if context_keep is not None and len(tokens) > n_ctx:
        return f"prompt of {len(tokens)} tokens exceeds the context window n_ctx={n_ctx}", None
    if context_keep is None and not fits(len(tokens), length, n_ctx):
        return f"prompt of {len(tokens)} tokens + --length {length} - 1 exceeds the context window n_ctx={n_ctx}", \
            None
    try:
        return None, line_controls(row, n_vocab)
    except ValueError as e:
        return str(e), None


def plan_batches(lines, enc, *, n_ctx, length, n_vocab, batch_size, context_keep=None):
    """(batches, bad) for the lines of `read_prompts`: the batches, lists of (line, prompt,
    tokens, controls) of one length bucket and the same controls (`line_controls`) each, in
    the order of their controls, then smallest bucket first, a line with its own "seed"
    alone; and the bad lines, (line number, what is wrong), in line order."""
    buckets, bad = {}, []
    for n, row in lines:
        prompt = None if isinstance(row, ValueError) else row["prompt"]
        tokens = [] if prompt is None else enc.encode(prompt)
        wrong, fields = problem(row, tokens, n_ctx=n_ctx, length=length, n_vocab=n_vocab, context_keep=context_keep)
        if wrong is not None:
            bad.append((n, wrong))
            continue
        key = (json.dumps(fields), bucket(len(tokens))) + ((n,) if "seed" in dict(fields) else ())
        buckets.setdefault(key, []).append((n, prompt, tokens, fields))
    return [rows[i:i + batch_size] for _, rows in sorted(buckets.items())
            for i in range(0, len(rows), batch_size)], bad
