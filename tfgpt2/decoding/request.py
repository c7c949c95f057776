"""The rules of a generation request, each written once, and the request they make: `Request`,
every control of a generation (as vLLM's `SamplingParams`), checked once when `check_request`
makes it. Every door asks these rules and translates its own spelling into them: the library
(`tfgpt2.generate`, `generate_litert`), the commands' flags, JSONL lines (`json_stop`,
`json_logit_bias`, which the server's protocol reads its JSON with too), HTTP requests, and
the SavedModel's signatures (as graph ops: `assert_request`, `controls.assert_controls`).

    request = check_request(n_vocab=hp.n_vocab, n_ctx=hp.n_ctx, names={"length": "max_tokens"},
                            length=16, temperature=0.7, top_k=40, stop=["\n"])
    prompts = check_prompts(prompts, hp.n_vocab)
    check_window(max(map(len, prompts)), request.length, hp.n_ctx, context_keep=request.context_keep)

`check_request` returns a `Request` of checked values, or raises ValueError naming the first
bad field as `names` spells it ("max_tokens must be an integer in [1, 2**31), got 0"): the
message the door shows its user. The prompts are checked on their own (`check_prompts`), and
against the length (`check_window`: `fits`); `check_value` checks one number.
"""
import dataclasses
import math
import numbers
import re

import numpy as np
import tensorflow as tf

from .. import seeds
from ..encoder import EOT_TOKEN
from ..inputs import in_vocabulary
from ..ranges import Range, shown  # noqa: F401  shown: how every door quotes a value

MAX_STOPS = 64  # stop strings, and stop token sequences, per request (evaluation tasks send dozens)
MAX_STOP_BYTES = 64  # the longest stop string, in UTF-8 bytes
MAX_LOGPROBS = 5  # the most likely tokens a request may ask for at each step (OpenAI's limit for completions)
BANNED = -100.0  # OpenAI's rule: a logit bias at or below it bans the token


RANGES = {
    "length": Range(int, 1, 2**31 - 1),  # new tokens
    "temperature": Range(float, 0, math.inf, "[)"),
    "top_k": Range(int, 0, 2**31 - 1),
    "top_p": Range(float, 0, 1),
    "min_p": Range(float, 0, 1),
    "seed": seeds.SEEDS,
    "repetition_penalty": Range(float, 0, math.inf, "()"),  # 1 is off
    "presence_penalty": Range(float, 0, math.inf, "[)"),
    "frequency_penalty": Range(float, 0, math.inf, "[)"),
    "logit_bias": Range(float, -math.inf, math.inf, "[)"),  # each value; -inf or <= BANNED bans
    "min_tokens": Range(int, 0, 2**31 - 1),
    "logprobs": Range(int, 0, MAX_LOGPROBS),
    "prompt_logprobs": Range(int, 0, MAX_LOGPROBS),
    "batch_size": Range(int, 1, 2**31 - 1),
    "chunk": Range(int, 1, 2**31 - 1),  # new tokens between a stream's pieces
}
"""Each number's range, by the library's name for it."""


def fits(prompt_tokens, length, n_ctx):
    """The one rule for lengths, the original's: prompt + length - 1 <= n_ctx (the last new
    token is never fed back). Python ints or tensors."""
    return prompt_tokens + length - 1 <= n_ctx


def check_value(field, value, name=None, value_range=None):
    """`value` as the int or float that `RANGES[field]` (or `value_range`) holds; else
    ValueError naming it `name` (default: the field). Bools and strings are refused."""
    return (value_range or RANGES[field]).check(value, name or field)


@dataclasses.dataclass(frozen=True)
class Request:
    """Every control of one generation, checked (made by `check_request`; `dataclasses.replace`
    makes a derived one, a row's seed): `length` new tokens at most (max_tokens) and at least
    `min_tokens` before end-of-text or a stop may end them; the sampling values; `logit_bias`
    ((token id, value) pairs); `stop` (texts: the text ends before the first one it contains,
    which is left out unless `include_stop_str_in_output`) and `stop_token_ids` (token-id
    sequences, each left out likewise); `stop_at_eot` (end at `eot`, vLLM's `not ignore_eos`);
    `seed`; `logprobs` (each new token's log-probability and the that many most likely, None for
    none) and `prompt_logprobs` (the prompt's); `context_keep` (None: prompt + length fits the
    window; else go on past it from the last that many tokens)."""
    length: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()
    stop: tuple = ()
    stop_token_ids: tuple = ()
    include_stop_str_in_output: bool = False
    stop_at_eot: bool = False
    eot: int = EOT_TOKEN
    min_tokens: int = 0
    seed: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    context_keep: int | None = None

    @property
    def ignore_eos(self):
        """vLLM's name: generate past end-of-text to the length."""
        return not self.stop_at_eot


def check_request(*, n_vocab, n_ctx, names=None, length, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                  repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, stop=None,
                  stop_token_ids=None, include_stop_str_in_output=False, stop_at_eot=False, eot=EOT_TOKEN,
                  min_tokens=0, seed=None, logprobs=None, prompt_logprobs=None, context_keep=None):
    """The `Request` of these fields, each checked (a seed of None drawn here, `seeds.draw`), or
    ValueError naming the first bad one as `names` ({field: the user's name}) spells it.
    `logit_bias` {token id: value}; `stop` a text or a list of texts; `stop_token_ids` a list of
    token ids (one-token stops) or token-id lists (sequences)."""
    names = names or {}
    name = lambda field: names.get(field, field)  # noqa: E731
    values = dict(length=length, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty, min_tokens=min_tokens,
                  seed=seeds.draw() if seed is None else seed)
    checked = {field: check_value(field, value, name(field)) for field, value in values.items()}
    if checked["min_tokens"] > checked["length"]:
        raise ValueError(f"{name('min_tokens')} must be at most {name('length')} ({checked['length']}), "
                         f"got {checked['min_tokens']}")
    for field, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        checked[field] = None if value is None else check_value(field, value, name(field))
    if context_keep is not None:
        checked["context_keep"] = check_value("context_keep", context_keep, name("context_keep"),
                                              Range(int, 1, n_ctx - 1))
    flags = dict(stop_at_eot=stop_at_eot, include_stop_str_in_output=include_stop_str_in_output)
    return Request(**checked, **{field: _flag(value, name(field)) for field, value in flags.items()},
                   logit_bias=_logit_bias(logit_bias, n_vocab, name("logit_bias")),
                   stop=_stop_strings(stop, name("stop")),
                   stop_token_ids=_stop_token_ids(stop_token_ids, n_vocab, name("stop_token_ids")),
                   eot=_token_ids([eot], n_vocab, name("eot"))[0])


def check_prompts(prompts, n_vocab, name="prompt"):
    """Each prompt as a 1-D int64 array of token ids in [0, n_vocab) (`inputs.in_vocabulary`),
    at least one prompt of at least one token."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError(f"{name}s must be a non-empty list of token lists")
    rows = []
    for row, p in enumerate(prompts):
        try:
            array = np.asarray(p)
        except ValueError:
            raise ValueError(f"{name} {row}: not a flat list of token ids") from None
        if array.size == 0:
            raise ValueError(f"{name} {row} is empty: every prompt needs at least one token "
                             "(<|endoftext|> for none)")
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{name} {row}: token ids must be a flat list of integers, "
                             f"got dtype {array.dtype} and shape {list(array.shape)}")
        bad = array[~in_vocabulary(array, n_vocab)]
        if bad.size:
            raise ValueError(f"{name} {row}: token ids must be in [0, n_vocab={n_vocab}), got {bad[:3].tolist()}")
        rows.append(array.astype(np.int64))
    return rows


def check_window(longest, length, n_ctx, *, context_keep=None, names=None):
    """The length rule for prompts of at most `longest` tokens and `length` new ones: they fit
    the context window n_ctx (`fits`), or, with `context_keep` in [1, n_ctx), each prompt fits
    alone and a longer length slides. Returns (length, context_keep), checked."""
    names = names or {}
    prompt, length_name = names.get("prompts", "prompt"), names.get("length", "length")
    length = check_value("length", length, length_name)
    if context_keep is not None:
        context_keep = check_value("context_keep", context_keep, names.get("context_keep"), Range(int, 1, n_ctx - 1))
    if not fits(longest, 1, n_ctx):
        raise ValueError(f"{prompt} of {longest} tokens exceeds the context window n_ctx={n_ctx}")
    if context_keep is None and not fits(longest, length, n_ctx):
        raise ValueError(f"{prompt} of {longest} tokens + {length_name} {length} - 1 exceeds the context window "
                         f"n_ctx={n_ctx}")
    return length, context_keep


def _flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be true or false, got {shown(value)}")
    return bool(value)


def _token_ids(tokens, n_vocab, name):
    """The tokens as ints, each a token id (`inputs.in_vocabulary`, asked once for all), else
    ValueError naming the first that is not."""
    ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_)) else -1 for t in tokens]
    known = in_vocabulary(np.array([i if abs(i) < 2**62 else -1 for i in ids], np.int64), n_vocab)
    if not known.all():
        bad = tokens[int(np.argmin(known))]
        raise ValueError(f"{name} must be a token id in [0, n_vocab={n_vocab}), got {shown(bad)}")
    return ids


def _logit_bias(bias, n_vocab, name):
    """((token id, value), ...) by id, of {token id: value}; a value -inf or <= BANNED bans the
    token, and not every token may be banned."""
    if not bias:
        return ()
    if not hasattr(bias, "items"):
        raise ValueError(f"{name} must be a mapping of token id to value, got {type(bias).__name__}")
    tokens = _token_ids(list(bias), n_vocab, f"{name} token")
    checked = dict(zip(tokens, (check_value("logit_bias", value, f"{name} value") for value in bias.values())))
    if len(checked) == n_vocab and max(checked.values()) <= BANNED:
        raise ValueError(f"{name} bans every token")
    return tuple(sorted(checked.items()))


def _stop_strings(stop, name):
    """The stop texts as a tuple: none, one text, or a list of at most MAX_STOPS non-empty ones,
    each at most MAX_STOP_BYTES bytes of UTF-8."""
    if stop is None or (not isinstance(stop, str) and hasattr(stop, "__len__") and not len(stop)):
        return ()
    texts = [stop] if isinstance(stop, str) else stop
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a text or a list of texts, got {shown(stop)}")
    if len(texts) > MAX_STOPS:
        raise ValueError(f"{name}: at most {MAX_STOPS} stop strings, got {len(texts)}")
    for n, text in enumerate(texts):
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"{name} {n} is not valid text (a lone surrogate): {text!r}") from None
        if not 0 < size <= MAX_STOP_BYTES:
            raise ValueError(f"{name} {n} must be 1 to {MAX_STOP_BYTES} bytes of UTF-8, got {size}: {text!r}")
    return tuple(texts)


def _stop_token_ids(stop, n_vocab, name):
    """Token-id sequences as a tuple of tuples, of a list of token ids (one-token sequences, as
    vLLM's stop_token_ids) or of token-id lists; at most MAX_STOPS."""
    if stop is None or (hasattr(stop, "__len__") and not len(stop) and not isinstance(stop, (str, bytes))):
        return ()
    if isinstance(stop, (str, bytes)) or not hasattr(stop, "__len__"):
        raise ValueError(f"{name} must be a list of token ids or of token-id lists, got {shown(stop)}")
    if len(stop) > MAX_STOPS:
        raise ValueError(f"{name}: at most {MAX_STOPS} stop sequences, got {len(stop)}")
    sequences = []
    for n, sequence in enumerate(stop):
        if isinstance(sequence, numbers.Integral) and not isinstance(sequence, (bool, np.bool_)):
            sequence = [sequence]
        if isinstance(sequence, (str, bytes, numbers.Number)) or not hasattr(sequence, "__len__") or not len(sequence):
            raise ValueError(f"{name} sequence {n} must be a token id or a non-empty list of token ids, "
                             f"got {sequence!r}")
        sequences.append(tuple(_token_ids(list(sequence), n_vocab, f"{name} sequence {n} token")))
    return tuple(sequences)


def json_stop(value, name="stop"):
    """A JSON field of stop strings (a string, or a list of strings; null for none) as the
    request takes it; ValueError naming the field for another shape. The server's protocol
    and bulk lines read theirs with it."""
    if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, str) for t in value)):
        return value
    raise ValueError(f"{name} must be a string or a list of strings, got {_json(value)}")


def json_logit_bias(value, name="logit_bias"):
    """A JSON object of token ids (as JSON keys: decimal digits alone, not "1_000", " 7 " or
    "+7", which Python's int() would read) to numbers, OpenAI's {"50256": -100}, as {token id:
    value}; ValueError naming the field for another shape (the values and ids are the request
    rules' to check)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f'{name} must be an object of token ids to numbers: {{"50256": -100}}, got {_json(value)}')
    bad = [key for key in value if not (isinstance(key, str) and re.fullmatch("[0-9]{1,10}", key))]
    if bad:
        raise ValueError(f"{name} keys must be token ids in decimal digits, got {shown(bad[0])}")
    return {int(k): v for k, v in value.items()}


def _json(value):
    import json
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


# ---- the same rules as graph ops, for requests of tensors (the SavedModel's) ---------------

def require(ok, message, *data):
    """An assert op: fails with `message` and `data` where `ok` is not all true."""
    return tf.debugging.Assert(tf.reduce_all(ok), [message, *data] if data else [message])


def in_range(field, x, name=None):
    """The assert op of `RANGES[field]` over the tensor x, naming it `name` (and up to three
    values outside the range)."""
    outside = tf.reshape(tf.logical_not(RANGES[field].holds(x)), [-1])
    return require(tf.logical_not(outside), f"{name or field} must be {RANGES[field]}",
                   tf.boolean_mask(tf.reshape(x, [-1]), outside)[:3])


def assert_request(ids, lengths, length, temperature, top_k, top_p, seed, *, hparams):
    """`check_request`'s rules over tensors, named as the SavedModel's inputs: `ids` [batch, P]
    (padding slots hold 0), `lengths` [batch] real tokens per row, `length` (max_new_tokens) new
    tokens. Overflow-proof: any int32 values pass or fail here, never wrap. Returns the ops."""
    n_vocab, n_ctx = hparams.n_vocab, hparams.n_ctx
    bad_id = tf.logical_not(in_vocabulary(ids, n_vocab))
    longest = tf.reduce_max(tf.concat([tf.cast(lengths, tf.int64), [0]], 0))
    return [
        require(tf.size(lengths) > 0, "there must be at least one prompt"),
        require(lengths > 0, "every prompt needs at least one token (<|endoftext|> for none)"),
        require(tf.logical_not(bad_id), f"token ids must be in [0, n_vocab={n_vocab})",
                tf.boolean_mask(ids, bad_id)[:3]),
        in_range("length", length, "max_new_tokens"),
        require(fits(longest, tf.cast(length, tf.int64), n_ctx),
                f"prompt tokens + max_new_tokens - 1 exceed the context window n_ctx={n_ctx}; "
                "the tokens of the longest prompt and max_new_tokens", longest, length),
        in_range("temperature", temperature),
        in_range("top_k", top_k),
        in_range("top_p", top_p),
        in_range("seed", seed),
    ]
