"""The sampler: one token per row from the logits, greedy or drawn after temperature, top-k,
top-p and min-p, by inverse CDF with a stateless uniform (`choose`, `inverse_cdf`); the original's
`top_k_logits` and `top_p_logits` (`tfgpt2.sample` shows them beside `sample_sequence`).

Nothing here sorts the vocabulary: on a CPU a sort of 50,257 logits costs about 10 ms per row,
so the k-th largest logit and the nucleus threshold are found by bisection.
"""
import numpy as np
import tensorflow as tf

FILTERED = -1e10  # the original's value for logits that top-k / top-p remove
UNROLLED = 64  # up to this many rows, each row's uniform is its own op; more rows: one loop over them
CDF_BLOCK = 256  # the inverse CDF's blocks (`inverse_cdf`)


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
        kth = _bisect(tf.reduce_min(key, -1), tf.reduce_max(key, -1), lambda t: _count(key >= t[:, None]) >= k)
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


def inverse_cdf(weights, u):
    """Per row of `weights` [batch, n] (>= 0, some > 0), the first index at which the running
    sum of the weights exceeds u [batch] (in [0, 1)) times their total: in two passes, no running
    sum over the whole row (XLA's CPU backend makes a cumulative sum of 50,257 values a
    multi-pass reduce-window, half of a 16-slot server step's sampling). The sums of CDF_BLOCK
    weights at a time and their running sum give the block the index falls in; that block's own
    running sum gives the index, which always holds a weight > 0 (the block's last such index
    where its running sum, summed in another order, ends short of its sum)."""
    n = weights.shape[-1]
    whole = n // CDF_BLOCK * CDF_BLOCK  # the weights in whole blocks; the rest are one more block
    sums = []  # [batch, blocks]: each block's sum
    if whole:
        sums.append(tf.reduce_sum(tf.reshape(weights[:, :whole], [tf.shape(weights)[0], -1, CDF_BLOCK]), -1))
    if whole < n:
        sums.append(tf.reduce_sum(weights[:, whole:], -1, keepdims=True))
    sums = tf.concat(sums, 1)
    ends = tf.cumsum(sums, -1)  # the running sum at each block's end
    target = u * ends[:, -1]
    block = _count(ends <= target[:, None])  # target < the total: a block of weight > 0
    before = tf.where(block > 0, tf.gather(ends, tf.maximum(block - 1, 0), batch_dims=1), 0.0)
    index = block[:, None] * CDF_BLOCK + tf.range(CDF_BLOCK)
    inside = tf.where(index < n, tf.gather(weights, tf.minimum(index, n - 1), batch_dims=1), 0.0)
    cdf = before[:, None] + tf.cumsum(inside, -1)
    return block * CDF_BLOCK + tf.minimum(_count(cdf <= target[:, None]), _last(inside > 0))


def _count(x):
    """Per row, how many of x [batch, n] (bool) hold."""
    return tf.reduce_sum(tf.cast(x, tf.int32), -1)


def _last(x):
    """Per row, the last index at which x [batch, n] (bool) holds (-1: none)."""
    return tf.reduce_max(tf.where(x, tf.range(tf.shape(x)[-1]), -1), -1)


@tf.function(jit_compile=True, autograph=False)
def _uniform(n, seed):
    """n stateless uniforms for `seed`, always computed by XLA: TensorFlow's own kernel draws
    other numbers for the same seed, and generation should not depend on XLA. `seed` is a pair
    (n numbers of its stream) or one pair per row [n, 2] (the first number of each row's own
    stream: what the row draws when it is generated alone)."""
    seed = tf.convert_to_tensor(seed)
    if seed.shape.rank == 2 and seed.shape[0] is not None and seed.shape[0] <= UNROLLED:
        # unrolled: a loop waits for the host each step on a GPU
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
        # its static shape again: a call may reuse a trace of `_uniform` for rows of any number
        uniform = tf.ensure_shape(_uniform(tf.shape(weights)[0], seed), weights.shape[:1])
        token = inverse_cdf(weights, uniform)
        return tf.cond(tf.reduce_all(drawn), lambda: token, lambda: tf.where(drawn, token, greedy()))

    def greedy():
        return tf.argmax(logits, axis=-1, output_type=tf.int32)
    return tf.cond(tf.reduce_any(drawn), draw, greedy)
