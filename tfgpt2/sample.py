"""OpenAI's `src/sample.py` (`top_k_logits`, `top_p_logits`, `sample_sequence`) as one
XLA-compiled generation loop.

The loop runs over a key/value cache of fixed size written in place
(`GPT2.call_with_cache`), not the original's growing `tf.concat`. Prompts are left-padded
to a length bucket and the cache sized to a total-length bucket, so XLA compiles once per
(batch size, prompt bucket, total bucket), not once per prompt. Nothing here sorts the
vocabulary: on a CPU a sort of 50,257 logits costs about 10 ms per row, so the k-th largest
logit and the nucleus threshold are found by bisection, and tokens are drawn by inverse CDF.

The planner (`plan`, `transpose_pays`) and the checks (`check_request`) are TensorFlow ops,
shared by `generate` (eagerly, where a failed check raises ValueError at once) and the
SavedModel's `generate` signature (`export.py`, in its graph).
"""
import logging
import numbers

import numpy as np
import tensorflow as tf

from .encoder import EOT_TOKEN
from .model import shape_list

FILTERED = -1e10  # the original's value for logits that top-k / top-p remove
TRANSPOSE_FROM = 16  # new tokens from which generation on a CPU changes how it multiplies by the weights
SPLIT_K = 8          # at batch 1, into how many products over slices of nx (`GPT2.split_layout`)


def _order_key(x):
    """int64 keys that sort like the float32 values of x (bit patterns, negatives flipped)."""
    bits = tf.bitcast(x, tf.int32)
    return tf.cast(tf.where(bits < 0, bits ^ tf.constant(0x7FFFFFFF), bits), tf.int64)


def _bisect(lo, hi, predicate):
    """Per row, the largest integer v in [lo, hi] with predicate(v) true, for a predicate
    that is true up to some point and false after it; lo - 1 where it is nowhere true."""
    def body(lo, hi):
        mid = lo + (hi - lo + 1) // 2
        ok = predicate(mid)
        return tf.where(ok, mid, lo), tf.where(ok, hi, mid - 1)
    lo, _ = tf.while_loop(lambda lo, hi: tf.reduce_any(lo < hi), body, [lo - 1, hi])
    return lo


def _value_at_key(logits, key, threshold):
    """The smallest logit whose key is >= threshold (per row)."""
    return tf.reduce_min(tf.where(key >= threshold[:, None], logits, np.inf), axis=-1)


def top_k_logits(logits, k):
    """Keep each row's k largest logits (and any tied with the k-th); the rest become -1e10.
    k=0 keeps everything. k may be a tensor."""
    def _top_k():
        key = _order_key(logits)
        count = lambda t: tf.reduce_sum(tf.cast(key >= t[:, None], tf.int32), axis=-1)  # noqa: E731
        kth = _bisect(tf.reduce_min(key, -1), tf.reduce_max(key, -1), lambda t: count(t) >= k)
        min_values = tf.cond(tf.equal(k, 1), lambda: tf.reduce_max(logits, -1),
                             lambda: _value_at_key(logits, key, kth))
        return tf.where(logits < min_values[:, None], tf.cast(FILTERED, logits.dtype), logits)
    k = tf.minimum(tf.cast(k, tf.int32), tf.shape(logits)[-1])
    return tf.cond(tf.equal(k, 0), lambda: logits, _top_k)


def top_p_logits(logits, p):
    """Nucleus sampling, the original's rule: sorted by probability, keep the tokens whose
    cumulative probability is <= p, and always at least the most likely one.

    Unlike the original (whose `min_values` lacks a trailing axis, so it fails for any batch
    > 1, even at p=1), this works for any batch. p >= 1 keeps everything.
    """
    def _top_p():
        probs = tf.nn.softmax(logits, axis=-1)
        key = _order_key(logits)
        mass = lambda t: tf.reduce_sum(tf.where(key >= t[:, None], probs, 0), axis=-1)  # noqa: E731
        top = tf.reduce_max(key, -1)
        # the smallest threshold whose mass is <= p, but never above the most likely token
        threshold = tf.minimum(_bisect(tf.reduce_min(key, -1), top, lambda t: mass(t) > p) + 1, top)
        min_values = _value_at_key(logits, key, threshold)
        return tf.where(logits < min_values[:, None], tf.cast(FILTERED, logits.dtype), logits)
    return tf.cond(tf.cast(p, tf.float32) < 1, _top_p, lambda: logits)


@tf.function(jit_compile=True)
def _uniform(n, seed):
    """n stateless uniforms for `seed` (a pair), always computed by XLA: TensorFlow's own
    kernel draws other numbers for the same seed, and generation should not depend on XLA."""
    return tf.random.stateless_uniform([n], seed=seed, alg="philox")


def choose(logits, *, temperature, top_k, top_p, seed, filters=(True, True)):
    """One token per row: greedy at temperature 0, else drawn from softmax(logits / T) after
    top-k then top-p, by inverse CDF with a stateless uniform (`seed` is a pair). `filters`
    (Python bools: top-k, top-p) leaves a filter out of the graph where the request cannot use
    it (top_k 0, top_p 1), as the original's `top_k_logits` returns at once for k=0."""
    def draw():
        filtered = logits / temperature
        if filters[0]:
            filtered = top_k_logits(filtered, top_k)
        if filters[1]:
            filtered = top_p_logits(filtered, top_p)
        weights = tf.exp(filtered - tf.reduce_max(filtered, axis=-1, keepdims=True))
        cdf = tf.cumsum(weights, axis=-1)
        u = _uniform(tf.shape(cdf)[0], seed) * cdf[:, -1]
        token = tf.reduce_sum(tf.cast(cdf <= u[:, None], tf.int32), axis=-1)
        return tf.minimum(token, tf.shape(logits)[-1] - 1)
    return tf.cond(temperature > 0, draw, lambda: tf.argmax(logits, axis=-1, output_type=tf.int32))


# ---- the planner and the checks, shared with the SavedModel ------------------------------

def bucket(n, *, minimum=16):
    """The length bucket for n: the first of 16, 24, 32, 48, 64, 96, ... (powers of two and
    1.5 times them) that holds it, so that padding wastes less than a third."""
    size = minimum
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def _bucket_of(n, largest):
    """`bucket(n)` as a tensor, for 1 <= n <= largest."""
    sizes = tf.constant(sorted({bucket(m) for m in range(1, largest + 1)}))
    return tf.reduce_min(tf.where(sizes >= n, sizes, sizes[-1]))


def plan(longest, length, n_ctx, *, one_alone=True):
    """(prompt_len, total) for prompts of at most `longest` tokens and `length` new ones: the
    prompts are left-padded to prompt_len, and the token buffer and cache hold total. For a
    request that `check_request` passed; ints or int32 tensors. With `one_alone`, one-token
    prompts (the sample scripts' start token) get a prompt_len of 1: nothing to run before the
    loop, so nothing more to compile. The SavedModel, whose loop is traced once for prompts of
    any length and so always runs the prompt first, plans without it."""
    prompt_len = tf.minimum(_bucket_of(longest, n_ctx), n_ctx)
    if one_alone:
        prompt_len = tf.where(tf.equal(longest, 1), 1, prompt_len)
    total = tf.minimum(_bucket_of(prompt_len + length, 2 * n_ctx), prompt_len + n_ctx)
    return prompt_len, total


def transpose_pays(length, *, on_cpu, jit_compile=True):
    """Whether decoding multiplies by the block weights in another layout (`weights_for`,
    `GPT2.transposed_weights`): on a CPU, under XLA, from TRANSPOSE_FROM new tokens on, which
    repay the copy made above batch 1 (340 MB for 124M, freed after the call)."""
    return tf.logical_and(bool(on_cpu and jit_compile), length >= TRANSPOSE_FROM)


def _require(ok, message, *data):
    """A check: eagerly, raises ValueError(message: data) at once when `ok` is not all true;
    in a graph, an assert op to gate results on (its message and data in the error)."""
    ok = tf.reduce_all(ok)
    if tf.executing_eagerly():
        if not bool(ok):
            shown = ", ".join(str(np.asarray(d).tolist()) for d in data)
            raise ValueError(message + (f"; got {shown}" if data else ""))
        return tf.no_op()
    return tf.debugging.Assert(ok, [message, *data] if data else [message])


def check_request(ids, lengths, length, temperature, top_k, top_p, *, hparams):
    """The checks of a generation request, each naming what is wrong: `ids` [batch, P]
    (padding slots hold 0), `lengths` [batch] real tokens per row, `length` new tokens.
    Overflow-proof: any int32 values pass or fail here, never wrap. Returns ops (graph)."""
    n_vocab, n_ctx = hparams.n_vocab, hparams.n_ctx
    lengths64, length64 = tf.cast(lengths, tf.int64), tf.cast(length, tf.int64)
    bad_id = tf.logical_or(ids < 0, ids >= n_vocab)
    longest = tf.reduce_max(tf.concat([lengths64, [0]], 0))
    return [
        _require(tf.size(lengths) > 0, "there must be at least one prompt"),
        _require(lengths > 0, "every prompt needs at least one token (use start_token for none)"),
        _require(tf.logical_not(bad_id), f"token ids must be in [0, n_vocab={n_vocab})",
                 tf.boolean_mask(ids, bad_id)[:3]),
        _require(length64 >= 1, "length (max_new_tokens) must be >= 1", length),
        # prompt + length - 1 <= n_ctx: the last new token is never fed back, as in the original
        _require(length64 <= n_ctx + 1 - longest,
                 f"prompt tokens + length (max_new_tokens) - 1 must be <= n_ctx={n_ctx}; "
                 "longest prompt and length", longest, length),
        _require(tf.logical_and(tf.math.is_finite(temperature), temperature >= 0),
                 "temperature must be a finite number >= 0", temperature),
        _require(top_k >= 0, "top_k must be >= 0", top_k),
        _require(tf.logical_and(top_p >= 0, top_p <= 1), "top_p must be in [0, 1]", top_p),
    ]


class _ExpectedRetracing(logging.Filter):
    """Drops TensorFlow's "triggered tf.function retracing" warning for the generation loop,
    which compiles once per bucket by design; other functions keep it."""

    def filter(self, record):
        message = record.getMessage()
        return not ("retracing" in message and "Generator." in message)


tf.get_logger().addFilter(_ExpectedRetracing())


# ---- the compiled loop --------------------------------------------------------------------

class Generator:
    """The compiled generation loop for one model, kept on it (`generator_for`).

    `generate_padded` runs a whole generation as one `tf.function` (XLA when `jit_compile`)
    over left-padded prompts. `start` (the prompt but its last token) and `resume` (new
    tokens, up to a count) run it in pieces, to report progress between them. Each takes the
    layout of the block weights first (`weights_for`). `traces` counts how often any of them
    was traced, that is compiled.
    """

    def __init__(self, model, *, jit_compile=True):
        self.model = model
        self.jit_compile = jit_compile
        self.on_cpu = "CPU" in model.wte.value.device
        self.traces = 0
        self.generate_padded, self.start, self.resume = (
            tf.function(self._counted(f), jit_compile=jit_compile) for f in (self._generate, self._start, self._resume))
        self.transposed = tf.function(model.transposed_weights)

    def _counted(self, f):
        def traced(*args):
            self.traces += 1
            return f(*args)
        return traced

    def weights_for(self, length, batch):
        """Where `transpose_pays`: at batch 1 `split_layout(SPLIT_K)` (no copy, and faster
        there), at more rows `transposed()`. Else None."""
        if not bool(transpose_pays(length, on_cpu=self.on_cpu, jit_compile=self.jit_compile)):
            return None
        return self.model.split_layout(SPLIT_K) if batch == 1 else self.transposed()

    def _generate(self, weights, prompt, pad, tokens, length, *options):
        """prompt [batch, P] left-padded by pad [batch]; tokens [batch, T] is the output buffer,
        whose width T (>= P + length) sizes the cache. `options` are temperature, top_k, top_p,
        seed, eot, stop_at_eot and, optionally, `choose`'s filters. Returns tokens with the
        prompt and up to `length` new tokens after it (eot after a row stops), and each row's
        count of new tokens."""
        state = self._start(weights, prompt, pad, tokens, *options)
        state = self._resume(weights, state, pad, shape_list(prompt)[1], length, *options)
        return state["tokens"], state["lengths"]

    def _start(self, weights, prompt, pad, tokens, *options):
        """The prompt but its last token through the model, as the original's
        `sample_sequence`: the state `_resume` continues from that token, so that the sampler
        is compiled once, in the loop."""
        batch, prompt_len = shape_list(prompt)
        cache = self.model.empty_cache(batch, shape_list(tokens)[1])
        if prompt.shape[1] != 1:  # unknown where the SavedModel traces it: see `plan`
            _, cache = self.model.call_with_cache(prompt[:, :-1], cache, 0, pad=pad, weights=weights)
        return dict(i=tf.constant(0), token=prompt[:, -1], cache=cache,
                    tokens=tf.concat([prompt, tokens[:, prompt_len:]], axis=1),
                    done=tf.zeros([batch], tf.bool), lengths=tf.zeros([batch], tf.int32))

    def _resume(self, weights, state, pad, prompt_len, until, *options):
        """Generate from `state` until `until` new tokens, or until every row has stopped."""
        def body(state):
            logits, cache = self.model.call_with_cache(state["token"][:, None], state["cache"],
                                                       prompt_len + state["i"] - 1, pad=pad, weights=weights)
            return (_pick(dict(state, cache=cache), logits, prompt_len, *options),)

        def cond(state):
            return tf.logical_and(state["i"] < until, tf.logical_not(tf.reduce_all(state["done"])))
        return tf.while_loop(cond, body, (state,))[0]


def _pick(state, logits, prompt_len, temperature, top_k, top_p, seed, eot, stop_at_eot, filters=(True, True)):
    """New token number i (eot for rows already stopped), written after the prompt."""
    i, done = state["i"], state["done"]
    token = choose(logits, temperature=tf.cast(temperature, tf.float32), top_k=top_k, top_p=top_p,
                   seed=tf.stack([seed, tf.cast(i, tf.int64)]), filters=filters)
    token = tf.where(done, eot, token)
    tokens = tf.tensor_scatter_nd_update(state["tokens"], _column(token, prompt_len + i), token)
    return dict(state, i=i + 1, token=token, tokens=tokens,
                lengths=state["lengths"] + tf.cast(tf.logical_not(done), tf.int32),
                done=tf.logical_or(done, tf.logical_and(stop_at_eot, tf.equal(token, eot))))


def _column(values, index):
    """Scatter indices of column `index` for one value per row."""
    batch = tf.shape(values)[0]
    return tf.stack([tf.range(batch), tf.fill([batch], index)], axis=1)


def generator_for(model, *, jit_compile=True):
    """The model's `Generator`, kept in `model.generators` so that it lives and dies with the
    model (compiles are reused across calls)."""
    if jit_compile not in model.generators:
        model.generators[jit_compile] = Generator(model, jit_compile=jit_compile)
    return model.generators[jit_compile]


# ---- the library's entry points ---------------------------------------------------------

def _integer(name, value, *, low=None, high=None):
    """value as an int, or a ValueError naming `name`: floats, bools and strings are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if high is None and low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value}")
    return value


def _real(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _prompt_rows(prompts):
    """Each prompt as a 1-D int64 array; non-integer ids fail naming the prompt."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token lists")
    rows = []
    for row, p in enumerate(prompts):
        try:
            array = np.asarray(p)
        except ValueError:
            raise ValueError(f"prompt {row}: not a flat list of token ids") from None
        if array.size == 0:
            array = array.astype(np.int64)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"prompt {row}: token ids must be a flat list of integers, "
                             f"got dtype {array.dtype} and shape {list(array.shape)}")
        rows.append(array.astype(np.int64))
    return rows


def generate(model, prompts, length, *, temperature=1.0, top_k=0, top_p=1.0, seed=None,
             stop_at_eot=False, eot=EOT_TOKEN, jit_compile=True, progress=None, chunk=32):
    """Continue each prompt (a list of token lists, lengths may differ) by up to `length`
    tokens. Returns a list of 1-D arrays, each prompt + its new tokens (cut after `eot`
    where `stop_at_eot`). Each row is generated as if alone (left padding, an attention mask,
    positions counted per row). With `progress`, a callable, the loop runs `chunk` tokens at
    a time and `progress(n)` is told the number of new tokens so far after each piece.

    Samples depend on `seed` and on the row's place in the batch, not on XLA (`jit_compile`).
    """
    hp = model.hparams
    prompts = _prompt_rows(prompts)
    length = _integer("length", length)
    top_k = _integer("top_k", top_k)
    temperature, top_p = _real("temperature", temperature), _real("top_p", top_p)
    seed = np.random.randint(2**31) if seed is None else _integer("seed", seed, low=0, high=2**63)
    eot = _integer("eot", eot, low=0, high=hp.n_vocab)
    lengths = np.array([len(p) for p in prompts])
    longest = int(lengths.max(initial=0))
    ids = np.zeros([len(prompts), max(longest, 1)], np.int64)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    check_request(tf.constant(ids), tf.constant(lengths, tf.int32), tf.constant(min(max(length, -2**31), 2**31 - 1)),
                  tf.constant(temperature, tf.float32), tf.constant(min(top_k, 2**31 - 1)),
                  tf.constant(top_p, tf.float32), hparams=hp)

    prompt_len, total = (int(n) for n in plan(longest, length, hp.n_ctx))
    padded = np.zeros([len(prompts), prompt_len], np.int32)
    for row, p in enumerate(prompts):
        padded[row, prompt_len - len(p):] = p
    pad = tf.constant(prompt_len - lengths, tf.int32)
    options = (tf.constant(temperature, tf.float32), tf.constant(top_k, tf.int32), tf.constant(top_p, tf.float32),
               tf.constant(seed, tf.int64), tf.constant(eot, tf.int32), tf.constant(bool(stop_at_eot)),
               (top_k != 0, top_p < 1))
    generator = generator_for(model, jit_compile=jit_compile)
    weights = generator.weights_for(length, len(prompts))
    buffer = tf.zeros([len(prompts), total], tf.int32)
    if progress is None:
        tokens, new = generator.generate_padded(weights, tf.constant(padded), pad, buffer, tf.constant(length),
                                                *options)
    else:
        state = generator.start(weights, tf.constant(padded), pad, buffer, *options)
        while int(state["i"]) < length and not bool(tf.reduce_all(state["done"])):
            progress(int(state["i"]))
            until = tf.constant(min(int(state["i"]) + chunk, length))
            state = generator.resume(weights, state, pad, tf.constant(prompt_len), until, *options)
        progress(int(state["i"]))
        tokens, new = state["tokens"], state["lengths"]
    tokens, new = tokens.numpy(), new.numpy()
    return [tokens[row, prompt_len - len(p):prompt_len + new[row]] for row, p in enumerate(prompts)]


def sample_sequence(*, model, length, start_token=None, batch_size=None, context=None,
                    temperature=1, top_k=0, top_p=1, seed=None, stop_at_eot=False, jit_compile=True,
                    progress=None):
    """The original's `sample_sequence`: returns context + `length` sampled tokens as an array
    [batch, context_len + length], for `context` [batch, context_len] or `start_token` and
    `batch_size`. Works for any batch size (the original fails above 1) and at temperature 0
    (greedy). A `context` whose rows differ in length gives a list of arrays instead; so does
    `stop_at_eot`, whose rows end after their first `<|endoftext|>`. `progress`: see `generate`.
    """
    if (start_token is None) == (context is None):
        raise ValueError("Specify exactly one of start_token and context!")
    if start_token is not None:
        batch_size = _integer("batch_size", batch_size, low=1) if batch_size is not None else None
        if batch_size is None:
            raise ValueError("start_token needs batch_size")
        context = [[start_token]] * batch_size
    rows = generate(model, list(context), length, temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=seed, stop_at_eot=stop_at_eot, jit_compile=jit_compile, progress=progress)
    same = len({len(r) for r in rows}) == 1 and not stop_at_eot
    return np.stack(rows) if same else rows
