"""OpenAI's `src/sample.py`: `top_k_logits`, `top_p_logits` and `sample_sequence`, run as one
XLA-compiled generation loop (`tfgpt2.decoding`).

The loop runs over a key/value cache of fixed size written in place, not the original's
growing `tf.concat`. Prompts are left-padded to a length bucket and the cache sized to a
total-length bucket, so XLA compiles once per (batch size, prompt bucket, total bucket), not
once per prompt. Nothing here sorts the vocabulary: on a CPU a sort of 50,257 logits costs
about 10 ms per row, so the k-th largest logit and the nucleus threshold are found by
bisection, and tokens are drawn by inverse CDF.
"""
import numpy as np
import tensorflow as tf

from .decoding.loop import generator_for
from .decoding.plan import check_request, integer, plan, prompt_rows, real
from .encoder import EOT_TOKEN

FILTERED = -1e10  # the original's value for logits that top-k / top-p remove


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


# ---- the library's entry points ---------------------------------------------------------

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
    prompts = prompt_rows(prompts)
    length = integer("length", length)
    top_k = integer("top_k", top_k)
    temperature, top_p = real("temperature", temperature), real("top_p", top_p)
    seed = np.random.randint(2**31) if seed is None else integer("seed", seed, low=0, high=2**63)
    eot = integer("eot", eot, low=0, high=hp.n_vocab)
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
    generator = generator_for(model, choose, jit_compile=jit_compile)
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
        batch_size = integer("batch_size", batch_size, low=1) if batch_size is not None else None
        if batch_size is None:
            raise ValueError("start_token needs batch_size")
        context = [[start_token]] * batch_size
    rows = generate(model, list(context), length, temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=seed, stop_at_eot=stop_at_eot, jit_compile=jit_compile, progress=progress)
    same = len({len(r) for r in rows}) == 1 and not stop_at_eot
    return np.stack(rows) if same else rows
