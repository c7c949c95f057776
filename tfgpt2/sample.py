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

from .decoding.buckets import bucket_sizes
from .decoding.controls import aligned_stops
from .decoding.generator import generator_for
from .decoding.request import check_request, check_value, fits
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
    k=0 keeps everything. k may be a tensor, one for all rows or one per row [batch]."""
    def _top_k():
        key = _order_key(logits)
        count = lambda t: tf.reduce_sum(tf.cast(key >= t[:, None], tf.int32), axis=-1)  # noqa: E731
        kth = _bisect(tf.reduce_min(key, -1), tf.reduce_max(key, -1), lambda t: count(t) >= k)
        min_values = tf.where(tf.equal(k, 1), tf.reduce_max(logits, -1), _value_at_key(logits, key, kth))
        return _filtered(logits, tf.where(tf.equal(k, 0), -np.inf, min_values))
    k = tf.minimum(tf.cast(k, tf.int32), tf.shape(logits)[-1])
    return tf.cond(tf.reduce_all(tf.equal(k, 0)), lambda: logits, _top_k)


def top_p_logits(logits, p):
    """Nucleus sampling, the original's rule: sorted by probability, keep the tokens whose
    cumulative probability is <= p, and always at least the most likely one.

    Unlike the original (whose `min_values` lacks a trailing axis, so it fails for any batch
    > 1, even at p=1), this works for any batch. p >= 1 keeps everything. p may be a tensor,
    one for all rows or one per row [batch].
    """
    p = tf.cast(p, tf.float32)

    def _top_p():
        probs = tf.nn.softmax(logits, axis=-1)
        key = _order_key(logits)
        mass = lambda t: tf.reduce_sum(tf.where(key >= t[:, None], probs, 0), axis=-1)  # noqa: E731
        top = tf.reduce_max(key, -1)
        # the smallest threshold whose mass is <= p, but never above the most likely token
        threshold = tf.minimum(_bisect(tf.reduce_min(key, -1), top, lambda t: mass(t) > p) + 1, top)
        return _filtered(logits, tf.where(p < 1, _value_at_key(logits, key, threshold), -np.inf))
    return tf.cond(tf.reduce_any(p < 1), _top_p, lambda: logits)


def _filtered(logits, min_values):
    """The logits below each row's min_values [batch] set to -1e10 (FILTERED)."""
    return tf.where(logits < tf.cast(min_values, logits.dtype)[:, None], tf.cast(FILTERED, logits.dtype), logits)


def min_p_logits(logits, min_p):
    """Keep the tokens whose probability is >= min_p [batch] times the row's largest (the
    rest become -1e10); min_p 0 keeps all, 1 the most likely tokens only."""
    probs = tf.nn.softmax(logits, axis=-1)
    keep = probs >= min_p[:, None] * tf.reduce_max(probs, axis=-1, keepdims=True)
    return tf.where(keep, logits, tf.cast(FILTERED, logits.dtype))


@tf.function(jit_compile=True)
def _uniform(n, seed):
    """n stateless uniforms for `seed`, always computed by XLA: TensorFlow's own kernel draws
    other numbers for the same seed, and generation should not depend on XLA. `seed` is a pair
    (n numbers of its stream) or one pair per row [n, 2] (the first number of each row's own
    stream: what the row draws when it is generated alone)."""
    seed = tf.convert_to_tensor(seed)
    if seed.shape.rank == 2 and seed.shape[0] is not None:  # unrolled: a loop waits for the host each step on a GPU
        return tf.stack([tf.random.stateless_uniform([1], seed=seed[row], alg="philox")[0]
                         for row in range(seed.shape[0])])
    if seed.shape.rank == 2:
        return tf.map_fn(lambda s: tf.random.stateless_uniform([1], seed=s, alg="philox")[0], seed,
                         fn_output_signature=tf.float32)
    return tf.random.stateless_uniform([n], seed=seed, alg="philox")


def choose(logits, *, temperature, top_k, top_p, seed, filters=(True, True), min_p=None):
    """One token per row: greedy at temperature 0, else drawn from softmax(logits / T) after
    top-k, top-p, then min-p (`min_p` [batch], None for none), by inverse CDF with a stateless
    uniform (`_uniform`: `seed` a pair, or a pair per row). `temperature`, `top_k` and `top_p`
    are one for all rows or one per row [batch]. `filters` (Python bools: top-k, top-p) leaves
    a filter out of the graph where the request cannot use it (top_k 0, top_p 1), as the
    original's `top_k_logits` returns at once for k=0."""
    drawn = temperature > 0

    def draw():
        filtered = logits / tf.where(drawn, temperature, 1.0)[..., None]
        if filters[0]:
            filtered = top_k_logits(filtered, top_k)
        if filters[1]:
            filtered = top_p_logits(filtered, top_p)
        if min_p is not None:
            filtered = tf.cond(tf.reduce_any(min_p > 0), lambda: min_p_logits(filtered, min_p), lambda: filtered)
        weights = tf.exp(filtered - tf.reduce_max(filtered, axis=-1, keepdims=True))
        cdf = tf.cumsum(weights, axis=-1)
        u = _uniform(tf.shape(cdf)[0], seed) * cdf[:, -1]
        token = tf.reduce_sum(tf.cast(cdf <= u[:, None], tf.int32), axis=-1)
        return tf.where(drawn, tf.minimum(token, tf.shape(logits)[-1] - 1), greedy())

    def greedy():
        return tf.argmax(logits, axis=-1, output_type=tf.int32)
    return tf.cond(tf.reduce_any(drawn), draw, greedy)


# ---- the library's entry points ---------------------------------------------------------

def generate(model, prompts, length, *, temperature=1.0, top_k=0, top_p=1.0, seed=None,
             stop_at_eot=False, eot=EOT_TOKEN, jit_compile=True, progress=None, chunk=32,
             logit_bias=None, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
             min_p=0.0, stop=None, stream=False, context_keep=None):
    """Continue each prompt (a list of token lists, lengths may differ) by up to `length`
    tokens. Returns a list of 1-D arrays, each prompt + its new tokens (cut after `eot`
    where `stop_at_eot`). Each row is generated as if alone (left padding, an attention mask,
    positions counted per row). With `progress`, a callable, the loop runs `chunk` tokens at
    a time and `progress(n)` is told the number of new tokens so far after each piece.

    The controls, applied at each step in this order (docs/generation.md): `logit_bias` {token
    id: value added to its logit; -inf or <= -100 bans it}, `repetition_penalty` (CTRL's, over
    the prompt and the new tokens; 1 is off), `presence_penalty` and `frequency_penalty`
    (OpenAI's, over the new tokens), then temperature, top-k, top-p and `min_p`; `stop`, a list
    of token lists: a row ends as soon as its new tokens end with one, which is left out.

    `stream=True` returns an iterator instead, yielding every `chunk` steps a list of each
    row's new tokens since the last yield; joined, they are the new tokens of the call without
    it (a row's last tokens are held back while they could still begin a stop sequence).

    A `length` past the context window (prompt + length - 1 > n_ctx) slides: once the window is
    full, the rows go on from their last `context_keep` tokens (default n_ctx // 2), encoded
    afresh (`_sliding`, docs/generation.md).

    Samples depend on `seed` and on the row's place in the batch, not on XLA (`jit_compile`).
    This is the `model.generate` of the issue tracker and of other libraries.
    """
    hp = model.hparams
    request = check_request(
        prompts, length, n_vocab=hp.n_vocab, n_ctx=hp.n_ctx,
        context_keep=(hp.n_ctx // 2 or None) if context_keep is None else context_keep, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, stop_at_eot=stop_at_eot, eot=eot, logit_bias=logit_bias,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, min_p=min_p, stop=stop)
    chunk = check_value("chunk", chunk)
    prompts, length = request.prompts, request.length
    options = _options(request.sampling, hp.n_vocab, len(prompts))
    held = int(options[7]["stop"].shape[-1]) - 1 if len(options) > 7 and "stop" in options[7] else 0
    generator = generator_for(model, choose, jit_compile=jit_compile)
    if fits(max(map(len, prompts)), length, hp.n_ctx):
        return _in_window(generator, prompts, length, hp.n_ctx, options, chunk, progress, held if stream else None)
    pieces = _sliding(generator, prompts, length, request.context_keep, options,
                      chunk if stream or progress else length, progress)
    if stream:
        return _streamed(pieces, held)
    for rows, _, _ in pieces:
        pass
    return [np.concatenate([p.astype(np.int32), r]) for p, r in zip(prompts, rows)]


def _in_window(generator, prompts, length, n_ctx, options, chunk, progress, held):
    """`generate` of a request that fits the window: each row its prompt + new tokens, or, where
    `held` is not None (stream=True), an iterator of pieces (`_streamed`)."""
    prompt_len, total = (int(n) for n in bucket_sizes(max(map(len, prompts)), length, n_ctx))
    padded, pad = _padded(prompts, prompt_len)
    args = (generator.weights_for(length, len(prompts)), padded, pad, tf.zeros([len(prompts), total], tf.int32))
    if held is not None:
        return _streamed(_rows(_pieces(generator, args, prompt_len, length, chunk, options, progress), prompt_len),
                         held)
    if progress is None:
        tokens, new = generator.generate_padded(*args, tf.constant(length), *options)
    else:
        for state, _ in _pieces(generator, args, prompt_len, length, chunk, options, progress):
            pass
        tokens, new = state["tokens"], state["lengths"]
    tokens, new = tokens.numpy(), new.numpy()
    return [tokens[row, prompt_len - len(p):prompt_len + new[row]] for row, p in enumerate(prompts)]


def _padded(prompts, prompt_len):
    """The prompts left-padded to prompt_len (a tensor [batch, prompt_len]) and each row's padding."""
    padded = np.zeros([len(prompts), prompt_len], np.int32)
    for row, p in enumerate(prompts):
        padded[row, prompt_len - len(p):] = p
    return tf.constant(padded), tf.constant([prompt_len - len(p) for p in prompts], tf.int32)


def _pieces(generator, args, prompt_len, length, chunk, options, progress, carry=None):
    """Run the loop `chunk` new tokens at a time: yields (the loop's state, whether it is the
    last), telling `progress` (if any) the count of new tokens before and after each piece.
    `carry` replaces parts of the starting state (`_sliding`)."""
    state = dict(generator.start(*args, *options), **(carry or {}))
    while True:
        i = int(state["i"])
        if progress is not None:
            progress(i)
        if i >= length or bool(tf.reduce_all(state["done"])):
            return
        state = generator.resume(args[0], state, args[2], tf.constant(prompt_len),
                                 tf.constant(min(i + chunk, length)), *options)
        yield state, int(state["i"]) >= length or bool(tf.reduce_all(state["done"]))


def _rows(pieces, prompt_len):
    """Each piece as (each row's new tokens so far, which rows are done, whether it is the last)."""
    for state, last in pieces:
        tokens, new, done = (state[k].numpy() for k in ("tokens", "lengths", "done"))
        yield [tokens[row, prompt_len:prompt_len + new[row]] for row in range(len(new))], done, last


def _sliding(generator, prompts, length, keep, options, chunk, progress):
    """Generation past the context window, in segments: the first runs as a `length` that fits
    would (n_ctx + 1 - the longest prompt new tokens, so its tokens are the same); each next
    one starts afresh (positions from 0) from each row's last `keep` tokens. All rows slide
    together. The penalties' counts, the stopped rows and the random stream (token k of a row
    draws with (seed, k)) carry over, and stop sequences may span segments. Yields pieces as
    `_rows` does. Every segment after the first has the same shapes: two compiles in all."""
    n_ctx, batch = generator.model.hparams.n_ctx, len(prompts)
    new = [np.zeros(0, np.int32)] * batch  # each row's new tokens so far
    rows, carry, step = prompts, None, 0
    while True:
        longest = max(map(len, rows))
        window = n_ctx + 1 - longest
        count = min(window, length - step)
        prompt_len, total = (int(n) for n in bucket_sizes(longest, window, n_ctx))
        padded, pad = _padded(rows, prompt_len)
        args = (generator.weights_for(window, batch), padded, pad, tf.zeros([batch, total], tf.int32))
        told = None if progress is None else lambda i, step=step: progress(step + i)
        for state, last in _pieces(generator, args, prompt_len, count, chunk, _continued(options, step, rows, new),
                                   told, carry):
            tokens, lengths, done = (state[k].numpy() for k in ("tokens", "lengths", "done"))
            # a negative length: a stop sequence that began in an earlier segment, cut from it
            so_far = [np.concatenate([old[:len(old) + min(n, 0)], tokens[row, prompt_len:prompt_len + max(n, 0)]])
                      for row, (old, n) in enumerate(zip(new, lengths))]
            yield so_far, done, last and (step + count >= length or done.all())
        new, step = so_far, step + count
        if step >= length or done.all():
            return
        carry = {k: state[k] for k in ("done", "counts", "seen") if k in state}
        rows = [np.concatenate([p, n])[-keep:] for p, n in zip(prompts, new)]


def _continued(options, step, rows, new):
    """The loop's options for a segment that starts after `step` new tokens (`_sliding`): the
    controls tell the loop where the random stream is and, for stop sequences, how many of
    each row's prompt tokens are new ones."""
    if not step:
        return options
    controls = dict(options[7] if len(options) > 7 else {}, step=tf.constant(step))
    if "stop" in controls:
        controls["carried"] = tf.constant([min(len(r), len(n)) for r, n in zip(rows, new)], tf.int32)
    return options[:7] + (controls,)


def _streamed(pieces, held):
    """Each row's new tokens since the last piece, piece by piece (pieces as `_rows` yields
    them); the last `held` tokens of a running row wait until they cannot be part of a stop
    sequence any more."""
    sent = None
    for rows, done, last in pieces:
        new = np.array([len(row) for row in rows])
        sent = np.zeros_like(new) if sent is None else sent
        ready = np.where(done | last, new, np.maximum(sent, new - held))
        yield [row[start:end] for row, start, end in zip(rows, sent, ready)]
        sent = ready


def _options(sampling, n_vocab, batch):
    """The loop's options for checked sampling values (`request.check_sampling`): temperature,
    top_k, top_p, seed, eot, stop_at_eot, the filters `choose` may leave out (top_k 0, top_p 1)
    and, where the request uses any, the controls as the loop takes them (`decoding.controls`)."""
    controls = {}
    if sampling["logit_bias"]:
        bias = np.zeros([n_vocab], np.float32)
        bias[list(sampling["logit_bias"])] = list(sampling["logit_bias"].values())
        controls["bias"] = tf.constant(np.tile(bias, [batch, 1]))
    off = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0)
    used = {field for field, value in off.items() if sampling[field] != value}
    if {"presence_penalty", "frequency_penalty"} & used:  # one control in the loop, as OpenAI's formula
        used |= {"presence_penalty", "frequency_penalty"}
    controls.update((field.replace("_penalty", ""), tf.fill([batch], sampling[field])) for field in used)
    if sampling["stop"]:
        dense = np.full([len(sampling["stop"]), max(map(len, sampling["stop"]))], -1, np.int32)
        for n, sequence in enumerate(sampling["stop"]):
            dense[n, :len(sequence)] = sequence
        controls["stop"] = aligned_stops(tf.constant(np.tile(dense[None], [batch, 1, 1])))
    top_k, top_p = sampling["top_k"], sampling["top_p"]
    return (tf.constant(sampling["temperature"], tf.float32), tf.constant(top_k, tf.int32),
            tf.constant(top_p, tf.float32), tf.constant(sampling["seed"], tf.int64),
            tf.constant(sampling["eot"], tf.int32), tf.constant(sampling["stop_at_eot"]),
            (top_k != 0, top_p < 1)) + ((controls,) if controls else ())


def sample_sequence(*, model, length, start_token=None, batch_size=None, context=None,
                    temperature=1, top_k=0, top_p=1, seed=None, stop_at_eot=False, jit_compile=True,
                    progress=None, stream=False, context_keep=None, **controls):
    """The original's `sample_sequence`: returns context + `length` sampled tokens as an array
    [batch, context_len + length], for `context` [batch, context_len] or `start_token` and
    `batch_size`. Works for any batch size (the original fails above 1) and at temperature 0
    (greedy). A `context` whose rows differ in length gives a list of arrays instead; so does
    `stop_at_eot` or a `stop` control, whose rows may end early. `progress`, `stream`,
    `context_keep` (a `length` past n_ctx) and the controls (`logit_bias`, ..., `stop`): see `generate`.
    """
    if (start_token is None) == (context is None):
        raise ValueError("Specify exactly one of start_token and context!")
    if start_token is not None:
        batch_size = check_value("batch_size", batch_size) if batch_size is not None else None
        if batch_size is None:
            raise ValueError("start_token needs batch_size")
        context = [[start_token]] * batch_size
    rows = generate(model, list(context), length, temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=seed, stop_at_eot=stop_at_eot, jit_compile=jit_compile, progress=progress,
                    stream=stream, context_keep=context_keep, **controls)
    if stream:
        return rows
    same = len({len(r) for r in rows}) == 1 and not stop_at_eot and not controls.get("stop")
    return np.stack(rows) if same else rows
