"""The JSONL plan of bulk generation: each line read and checked, and the batches to generate.

Each input line is a JSON object with a "prompt" (text; other keys are ignored, blank lines
skipped), and, optionally, generation controls of its own (`FIELDS`) over the command's flags,
checked by the request rules (`decoding.request`) as the flags and the library are.

Batches: prompts are grouped by the generator's length bucket (`decoding.buckets.bucket` of
their token count) and their controls, and cut, in line order, into batches of `batch_size`;
a line with its own "seed" is a batch alone. Row r of batch b of the plan (counted from 0, in
the order of the controls, then smallest bucket first) samples with seed + b * batch_size + r
(`seeds.seed_of`). The plan depends
only on the input and `batch_size`, so a rerun, a resumed run and any number of workers give
each line the same text.
"""
import io
import json

from ..decoding.buckets import bucket
from ..decoding.request import check_request, check_window, json_logit_bias, json_stop

FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "logit_bias", "stop", "stop_token_ids", "stop_at_eot", "min_tokens",
          "include_stop_str_in_output")  # what a line may set over the flags
LINE_NAMES = {field: f"field {field!r}" for field in FIELDS} | {"prompts": "prompt", "length": "--length"}
"""The request's fields as the messages name them (the request rules', `decoding.request`)."""


def line_controls(row):
    """The sampling fields of an input line (`FIELDS`) as sorted (field, value) pairs: lines with
    equal pairs may share a batch. Raises ValueError for a field of the wrong JSON shape ("stop"
    a text or a list of texts, "logit_bias" an object with token ids as keys: the readers the
    server's protocol reads its fields with, `decoding.request.json_stop`, `json_logit_bias`);
    their values are the request rules' to check (`problem`)."""
    fields = []
    for name in sorted(set(row) & set(FIELDS)):
        value = row[name]
        if name == "stop":
            value = json_stop(value, LINE_NAMES[name])
            value = (value,) if isinstance(value, str) else tuple(value or ())
        if name == "logit_bias":
            value = tuple(sorted((json_logit_bias(value, LINE_NAMES[name]) or {}).items()))
        if name == "stop_token_ids" and isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        fields.append((name, value))
    return tuple(fields)


def line_keywords(fields):
    """A line's controls (`line_controls`) as the request's fields (logit_bias a dict), to put
    over the command's."""
    keywords = dict(fields)
    if "logit_bias" in keywords:
        keywords["logit_bias"] = dict(keywords["logit_bias"])
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


def problem(row, tokens, enc, *, n_ctx, length, n_vocab, context_keep):
    """What is wrong with a line (`read_prompts`' object or error, and the prompt's tokens), as
    the request rules say it (`decoding.request`), or its controls (`line_controls`) where
    nothing is."""
    if isinstance(row, ValueError):
        return str(row), None
    if not tokens:
        return "empty prompt", None
    try:
        check_window(len(tokens), length, n_ctx, context_keep=context_keep, names=LINE_NAMES)
        fields = line_controls(row)
        check_request(n_vocab=n_vocab, n_ctx=n_ctx, names=LINE_NAMES, length=length, **line_keywords(fields))
    except ValueError as e:
        return str(e), None
    return None, fields


def plan_batches(lines, enc, *, n_ctx, length, n_vocab, batch_size, context_keep=None):
    """(batches, bad) for the lines of `read_prompts`: the batches, lists of (line, prompt,
    tokens, controls) of one length bucket and the same controls (`line_controls`) each, in
    the order of their controls, then smallest bucket first, a line with its own "seed"
    alone; and the bad lines, (line number, what is wrong), in line order."""
    buckets, bad = {}, []
    for n, row in lines:
        prompt = None if isinstance(row, ValueError) else row["prompt"]
        tokens = [] if prompt is None else enc.encode(prompt)
        wrong, fields = problem(row, tokens, enc, n_ctx=n_ctx, length=length, n_vocab=n_vocab,
                                context_keep=context_keep)
        if wrong is not None:
            bad.append((n, wrong))
            continue
        key = (json.dumps(fields), bucket(len(tokens))) + ((n,) if "seed" in dict(fields) else ())
        buckets.setdefault(key, []).append((n, prompt, tokens, fields))
    return [rows[i:i + batch_size] for _, rows in sorted(buckets.items())
            for i in range(0, len(rows), batch_size)], bad
