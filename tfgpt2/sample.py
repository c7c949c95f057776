"""OpenAI's `src/sample.py` (`top_k_logits`, `top_p_logits`, `sample_sequence`) as one
XLA-compiled generation loop.

The loop runs over a key/value cache of fixed size written in place (`GPT2` with
`cache_index`), not the original's growing `tf.concat`. Prompts are left-padded to a length
bucket and the cache sized to a total-length bucket, so XLA compiles once per (batch size,
prompt bucket, total bucket), not once per prompt. Nothing here sorts the vocabulary: on a
CPU a sort of 50,257 logits costs about 10 ms per row, so the k-th largest logit and the
nucleus threshold are found by bisection, and tokens are drawn by inverse CDF.
"""
import weakref

import numpy as np
import tensorflow as tf

from .model import conv1d_layers, past_shape, shape_list, transposed_weights

FILTERED = -1e10  # the original's value for logits that top-k / top-p remove
TRANSPOSE_FROM = 16  # new tokens from which generation on a CPU copies the weights transposed


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


def choose(logits, *, temperature, top_k, top_p, seed):
    """One token per row: greedy at temperature 0, else drawn from softmax(logits / T) after
    top-k then top-p, by inverse CDF with a stateless uniform (`seed` is a pair)."""
    def draw():
        filtered = top_p_logits(top_k_logits(logits / temperature, top_k), top_p)
        weights = tf.exp(filtered - tf.reduce_max(filtered, axis=-1, keepdims=True))
        cdf = tf.cumsum(weights, axis=-1)
        u = tf.random.stateless_uniform(tf.shape(cdf)[:1], seed=seed) * cdf[:, -1]
        token = tf.reduce_sum(tf.cast(cdf <= u[:, None], tf.int32), axis=-1)
        return tf.minimum(token, tf.shape(logits)[-1] - 1)
    return tf.cond(temperature > 0, draw, lambda: tf.argmax(logits, axis=-1, output_type=tf.int32))


class Generator:
    """The compiled generation loop for one model.

    `generate_padded` runs a whole generation as one `tf.function` (XLA when `jit_compile`)
    over left-padded prompts. `start` (the prompt and the first new token) and `resume` (more
    tokens, up to a count) run it in pieces, to report progress between them. `traces`
    counts how often any of them was traced, that is compiled.
    """

    def __init__(self, model, *, jit_compile=True):
        self.model = model
        self.jit_compile = jit_compile
        self.traces = 0
        self.generate_padded, self.start, self.resume = (
            tf.function(self._counted(f), jit_compile=jit_compile) for f in (self._generate, self._start, self._resume))
        self.transposed = tf.function(lambda: tuple(
            tf.transpose(tf.reshape(conv.w, [-1, conv.nf])) for conv in conv1d_layers(model)))

    def _counted(self, f):
        """f, counting its traces; its first argument is () or `transposed()` (see there)."""
        def traced(weights, *args):
            self.traces += 1
            with transposed_weights(dict(zip(conv1d_layers(self.model), weights))):
                return f(*args)
        return traced

    def weights_for(self, length):
        """`transposed()`, each block weight copied as [nf, nx], where that pays: on a CPU
        under XLA (`model.transposed_weights` says why), for `length` >= TRANSPOSE_FROM new
        tokens, which repay the copy (340 MB for 124M, freed after the call).
        Otherwise ()."""
        on_cpu = "CPU" in self.model.wte.value.device
        return self.transposed() if self.jit_compile and on_cpu and length >= TRANSPOSE_FROM else ()

    def _generate(self, prompt, pad, tokens, length, *options):
        """prompt [batch, P] left-padded by pad [batch]; tokens [batch, T] is the output buffer,
        whose width T (>= P + length) sizes the cache. `options` are temperature, top_k, top_p,
        seed, eot, stop_at_eot. Returns tokens with the prompt and up to `length` new tokens
        after it (eot after a row stops), and each row's count of new tokens."""
        state = self._start(prompt, pad, tokens, *options)
        state = self._resume(state, pad, shape_list(prompt)[1], length, *options)
        return state["tokens"], state["lengths"]

    def _start(self, prompt, pad, tokens, *options):
        """The prompt through the model and the first new token: the state `_resume` continues."""
        hp = self.model.hparams
        batch, prompt_len = shape_list(prompt)
        cache_shape = past_shape(hparams=hp, batch_size=batch, sequence=shape_list(tokens)[1])
        cache = [(tf.zeros(cache_shape[:1] + cache_shape[3:]),) * 2 for _ in range(hp.n_layer)]
        out = self.model(prompt, cache, pad=pad, cache_index=0, last_only=True)
        state = dict(i=tf.constant(0), token=tf.zeros([batch], tf.int32), cache=out["present"],
                     tokens=tf.concat([prompt, tokens[:, prompt_len:]], axis=1),
                     done=tf.zeros([batch], tf.bool), lengths=tf.zeros([batch], tf.int32))
        return _pick(state, out["logits"][:, -1], prompt_len, *options)

    def _resume(self, state, pad, prompt_len, until, *options):
        """Generate from `state` until `until` new tokens, or until every row has stopped."""
        def body(state):
            out = self.model(state["token"][:, None], state["cache"], pad=pad,
                             cache_index=prompt_len + state["i"] - 1)
            return (_pick(dict(state, cache=out["present"]), out["logits"][:, 0], prompt_len, *options),)

        def cond(state):
            return tf.logical_and(state["i"] < until, tf.logical_not(tf.reduce_all(state["done"])))
        return tf.while_loop(cond, body, (state,))[0]


def _pick(state, logits, prompt_len, temperature, top_k, top_p, seed, eot, stop_at_eot):
    """New token number i (eot for rows already stopped), written after the prompt."""
    i, done = state["i"], state["done"]
    token = choose(logits, temperature=tf.cast(temperature, tf.float32), top_k=top_k, top_p=top_p,
                   seed=tf.stack([seed, tf.cast(i, tf.int64)]))
    token = tf.where(done, eot, token)
    batch = tf.shape(token)[0]
    tokens = tf.tensor_scatter_nd_update(
        state["tokens"], tf.stack([tf.range(batch), tf.fill([batch], prompt_len + i)], axis=1), token)
    return dict(state, i=i + 1, token=token, tokens=tokens,
                lengths=state["lengths"] + tf.cast(tf.logical_not(done), tf.int32),
                done=tf.logical_or(done, tf.logical_and(stop_at_eot, tf.equal(token, eot))))


_GENERATORS = weakref.WeakKeyDictionary()


def generator_for(model, *, jit_compile=True):
    """The model's `Generator` (one per model and XLA setting, so compiles are reused)."""
    per_model = _GENERATORS.setdefault(model, {})
    if jit_compile not in per_model:
        per_model[jit_compile] = Generator(model, jit_compile=jit_compile)
    return per_model[jit_compile]


def bucket(n, *, minimum=16):
    """The length bucket for n: the first of 16, 24, 32, 48, 64, 96, ... (powers of two and
    1.5 times them) that holds it, so that padding wastes less than a third."""
    size = minimum
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def generate(model, prompts, length, *, temperature=1.0, top_k=0, top_p=1.0, seed=None,
             stop_at_eot=False, eot=50256, jit_compile=True, progress=None, chunk=32):
    """Continue each prompt (a list of token lists, lengths may differ) by up to `length`
    tokens. Returns a list of 1-D arrays, each prompt + its new tokens (cut after `eot`
    where `stop_at_eot`). Each row is generated as if alone (left padding, an attention mask,
    positions counted per row). With `progress`, a callable, the loop runs `chunk` tokens at
    a time and `progress(n)` is told the number of new tokens so far after each piece."""
    hp = model.hparams
    prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    _check(prompts, length, hp, temperature=temperature, top_k=top_k, top_p=top_p)
    batch, longest = len(prompts), max(len(p) for p in prompts)
    prompt_len = min(bucket(longest), hp.n_ctx)
    total = min(bucket(prompt_len + length), prompt_len + hp.n_ctx)
    padded = np.zeros([batch, prompt_len], np.int32)
    for row, p in enumerate(prompts):
        padded[row, prompt_len - len(p):] = p
    pad = tf.constant([prompt_len - len(p) for p in prompts], tf.int32)
    if seed is None:
        seed = np.random.randint(2**31)
    options = (tf.constant(temperature, tf.float32), tf.constant(top_k, tf.int32), tf.constant(top_p, tf.float32),
               tf.constant(seed, tf.int64), tf.constant(eot, tf.int32), tf.constant(stop_at_eot))
    generator = generator_for(model, jit_compile=jit_compile)
    weights = generator.weights_for(length)
    buffer = tf.zeros([batch, total], tf.int32)
    if progress is None:
        tokens, lengths = generator.generate_padded(weights, tf.constant(padded), pad, buffer, tf.constant(length),
                                                    *options)
    else:
        state = generator.start(weights, tf.constant(padded), pad, buffer, *options)
        while int(state["i"]) < length and not bool(tf.reduce_all(state["done"])):
            progress(int(state["i"]))
            until = tf.constant(min(int(state["i"]) + chunk, length))
            state = generator.resume(weights, state, pad, tf.constant(prompt_len), until, *options)
        progress(int(state["i"]))
        tokens, lengths = state["tokens"], state["lengths"]
    tokens, lengths = tokens.numpy(), lengths.numpy()
    return [tokens[row, prompt_len - len(p):prompt_len + lengths[row]] for row, p in enumerate(prompts)]


def _check(prompts, length, hp, *, temperature, top_k, top_p):
    """Inputs are checked here, before XLA, which would clamp bad ids silently."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (use start_token for none)")
    if int(length) < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    for row, p in enumerate(prompts):
        bad = p[(p < 0) | (p >= hp.n_vocab)]
        if bad.size:
            raise ValueError(f"prompt {row}: token id {bad[0]} out of range [0, n_vocab={hp.n_vocab})")
        if len(p) + length - 1 > hp.n_ctx:  # the last new token is never fed back, as in the original
            raise ValueError(f"prompt {row}: {len(p)} tokens + length {length} - 1 exceeds the context "
                             f"window n_ctx={hp.n_ctx}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0 <= top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")


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
        if batch_size is None:
            raise ValueError("start_token needs batch_size")
        context = [[start_token]] * batch_size
    rows = generate(model, list(context), length, temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=seed, stop_at_eot=stop_at_eot, jit_compile=jit_compile, progress=progress)
    same = len({len(r) for r in rows}) == 1 and not stop_at_eot
    return np.stack(rows) if same else rows
