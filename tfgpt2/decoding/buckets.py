"""The length buckets that bound how often XLA compiles generation: prompts are left-padded to
a bucket and the token buffer and cache sized to one (`bucket_sizes`), so XLA compiles once per
(batch size, prompt bucket, total bucket), not once per prompt length.

`bucket_sizes` is TensorFlow ops, shared by `tfgpt2.generate` (eagerly) and the SavedModel's
`generate` signature (in its graph).
"""
import tensorflow as tf


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


def bucket_sizes(longest, length, n_ctx, *, one_alone=True):
    """(prompt_len, total) for prompts of at most `longest` tokens and `length` new ones: the
    prompts are left-padded to prompt_len, and the token buffer and cache hold total. For a
    request that `request.check_request` passed; ints or int32 tensors. With `one_alone`,
    one-token prompts (the sample scripts' start token) get a prompt_len of 1: nothing to run
    before the loop, so nothing more to compile. The SavedModel, whose loop is traced once for
    prompts of any length and so always runs the prompt first, plans without it."""
    prompt_len = tf.minimum(_bucket_of(longest, n_ctx), n_ctx)
    if one_alone:
        prompt_len = tf.where(tf.equal(longest, 1), 1, prompt_len)
    total = tf.minimum(_bucket_of(prompt_len + length, 2 * n_ctx), prompt_len + n_ctx)
    return prompt_len, total
