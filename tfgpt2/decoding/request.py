"""The rules of a generation request, each written once: which prompts, lengths and sampling
values a request may have. Every entry point asks them: the library (`tfgpt2.generate`,
`generate_litert`), the commands' flags, JSONL lines, HTTP requests, and the SavedModel's
signatures (as graph ops: `assert_request`, `controls.assert_controls`).

An entry point turns what its user sent into Python values (text into token ids, a JSON
object's keys into ints), then asks `check_request`, naming the fields as its users know them:

    request = check_request(prompts, length, n_vocab=hp.n_vocab, n_ctx=hp.n_ctx,
                            names={"length": "max_tokens", "prompts": "prompt"}, temperature=0.7, top_k=40)
    rows = tfgpt2.generate(model, request.prompts, request.length, context_keep=request.context_keep,
                           **request.sampling)

It returns a `Request` of checked values, or raises ValueError naming the first bad field as
`names` spells it ("max_tokens must be an integer in [1, 2**31), got 0"): the message the
entry point shows its user. Parts of a request can be checked on their own: `check_sampling`
(all but the prompts and the length: a command's flags, before any prompt is read),
`check_window` (the length against the prompts' lengths: `fits`), `check_value` (one number).
"""
import dataclasses
import math
import numbers
import reprlib

import numpy as np
import tensorflow as tf

from ..encoder import EOT_TOKEN
from ..inputs import in_vocabulary

BANNED = -100.0  # OpenAI's rule: a logit bias at or below it bans the token


@dataclasses.dataclass(frozen=True)
class Range:
    """Numbers of `kind` (int or float) from `low` to `high`: an int range holds both ends, a
    float one the ends that `ends` brackets ("[]", "[)", "()"); a float range open at inf holds
    finite numbers only. `holds` takes Python numbers, NumPy arrays and tensors alike (NaN never
    holds)."""
    kind: type
    low: float
    high: float
    ends: str = "[]"

    def holds(self, x):
        if isinstance(x, tf.Tensor) and x.dtype.is_integer:
            x = tf.cast(x, tf.int64)
        above = x >= self.low if self.ends[0] == "[" else x > self.low
        below = x <= self.high if self.ends[1] == "]" else x < self.high
        return above & below

    def __str__(self):
        if self.kind is int:
            return f"an integer in [{_number(self.low)}, {_number(self.high + 1)})"
        if self.high == math.inf and self.low == -math.inf:
            return "a number < inf"
        if self.high == math.inf:
            return f"a finite number {'>=' if self.ends[0] == '[' else '>'} {_number(self.low)}"
        return f"a number in {self.ends[0]}{_number(self.low)}, {_number(self.high)}{self.ends[1]}"


def _number(n):
    """n as a range shows it: 2**31 for a power of two from 2**16, 0.5 for a float."""
    if float(n).is_integer() and n >= 2**16 and int(n) & (int(n) - 1) == 0:
        return f"2**{int(n).bit_length() - 1}"
    return str(int(n)) if float(n).is_integer() else f"{n:g}"


RANGES = {
    "length": Range(int, 1, 2**31 - 1),  # new tokens
    "temperature": Range(float, 0, math.inf, "[)"),
    "top_k": Range(int, 0, 2**31 - 1),
    "top_p": Range(float, 0, 1),
    "min_p": Range(float, 0, 1),
    "seed": Range(int, 0, 2**63 - 1),  # the SavedModel's int64
    "repetition_penalty": Range(float, 0, math.inf, "()"),  # 1 is off
    "presence_penalty": Range(float, 0, math.inf, "[)"),
    "frequency_penalty": Range(float, 0, math.inf, "[)"),
    "logit_bias": Range(float, -math.inf, math.inf, "[)"),  # each value; -inf or <= BANNED bans
    "batch_size": Range(int, 1, 2**31 - 1),
    "chunk": Range(int, 1, 2**31 - 1),  # new tokens between a stream's pieces
}
"""Each number's range, by the library's name for it."""


def fits(prompt_tokens, length, n_ctx):
    """The one rule for lengths, the original's: prompt + length - 1 <= n_ctx (the last new
    token is never fed back). Python ints or tensors."""
    return prompt_tokens + length - 1 <= n_ctx


def batch_seed(seed, batch):
    """The seed of batch number `batch` of a run seeded `seed`: seed + batch, wrapped into the
    seed's range (the commands' rule: batches differ, runs repeat)."""
    return (seed + batch) % (RANGES["seed"].high + 1)


def check_value(field, value, name=None, value_range=None):
    """`value` as the int or float that `RANGES[field]` (or `value_range`) holds; else
    ValueError naming it `name` (default: the field). Bools and strings are refused."""
    value_range = value_range or RANGES[field]
    ok = isinstance(value, numbers.Integral if value_range.kind is int else numbers.Real) and not isinstance(
        value, (bool, np.bool_))
    try:
        ok = ok and bool(value_range.holds(value_range.kind(value)))
    except OverflowError:  # a float beyond float64
        ok = False
    if not ok:
        raise ValueError(f"{name or field} must be {value_range}, got {shown(value)}")
    return value_range.kind(value)


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


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: `prompts` 1-D int64 arrays, `length` new tokens, `context_keep` (None:
    the request fits the window) and `sampling`, `tfgpt2.generate`'s other keywords."""
    prompts: list
    length: int
    context_keep: int | None
    sampling: dict


def check_request(prompts, length, *, n_vocab, n_ctx, context_keep=None, names=None, **sampling):
    """The whole request checked (`check_prompts`, `check_window`, `check_sampling`), or
    ValueError naming the first bad field as `names` ({field: the user's name}) spells it.
    `context_keep` None: prompt + length must fit the window n_ctx (`fits`); an int: a longer
    length slides, going on from each row's last context_keep tokens."""
    names = names or {}
    prompts = check_prompts(prompts, n_vocab, names.get("prompts", "prompt"))
    length, context_keep = check_window(max(map(len, prompts)), length, n_ctx, context_keep=context_keep,
                                        names=names)
    return Request(prompts, length, context_keep, check_sampling(n_vocab, names=names, **sampling))


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


def check_sampling(n_vocab, *, names=None, temperature=1.0, top_k=0, top_p=1.0, seed=None, min_p=0.0,
                   repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, stop=None,
                   stop_at_eot=False, eot=EOT_TOKEN):
    """The sampling fields checked, as `tfgpt2.generate` takes them: numbers in their `RANGES`,
    `logit_bias` {token id: value}, `stop` a list of non-empty token lists, `stop_at_eot` a
    bool, `eot` a token id; a seed of None drawn here. ValueError names the first bad one."""
    names = names or {}
    numbers_ = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, seed=np.random.randint(2**31) if seed is None else seed)
    checked = {field: check_value(field, value, names.get(field)) for field, value in numbers_.items()}
    if not isinstance(stop_at_eot, (bool, np.bool_)):
        raise ValueError(f"{names.get('stop_at_eot', 'stop_at_eot')} must be true or false, got {shown(stop_at_eot)}")
    return dict(checked, logit_bias=_logit_bias(logit_bias, n_vocab, names.get("logit_bias", "logit_bias")),
                stop=_stop(stop, n_vocab, names.get("stop", "stop")), stop_at_eot=bool(stop_at_eot),
                eot=_token_ids([eot], n_vocab, names.get("eot", "eot"))[0])


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
    """{token id: value}; a value -inf or <= BANNED bans the token, and not every token may be banned."""
    if not bias:
        return {}
    if not hasattr(bias, "items"):
        raise ValueError(f"{name} must be a mapping of token id to value, got {type(bias).__name__}")
    tokens = _token_ids(list(bias), n_vocab, f"{name} token")
    checked = dict(zip(tokens, (check_value("logit_bias", value, f"{name} value") for value in bias.values())))
    if len(checked) == n_vocab and max(checked.values()) <= BANNED:
        raise ValueError(f"{name} bans every token")
    return checked


def _stop(stop, n_vocab, name):
    """A list of non-empty token lists."""
    if not stop:
        return []
    if isinstance(stop, (str, bytes)) or not hasattr(stop, "__len__"):
        raise ValueError(f"{name} must be a list of token lists (encode strings with the encoder)")
    sequences = []
    for n, sequence in enumerate(stop):
        if isinstance(sequence, (str, bytes, numbers.Number)) or not hasattr(sequence, "__len__") or not len(sequence):
            raise ValueError(f"{name} sequence {n} must be a non-empty list of token ids, got {sequence!r}")
        sequences.append(_token_ids(list(sequence), n_vocab, f"{name} sequence {n} token"))
    return sequences


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
