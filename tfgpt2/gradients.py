"""The gradients written out for `model.py`'s layers, and the recomputing block of `remat`.

Autodiff's gradients are right, but outside XLA several are a dozen operations over tensors of
[batch, sequence, 4 * n_embd] or [batch, heads, T, T], and under XLA some of their cheap pieces
are fused, recomputed, into every block below (docs/performance.md, Training). Here each is the
same math in few operations: `written(grad)` gives a function of model.py the gradient
`grad(dy, *saved)`, from what its forward pass saved.
"""
import functools

import numpy as np
import tensorflow as tf


def written(grad):
    """Decorates `f(x, *rest) -> (y, saved)`: the function of the same arguments that returns y,
    whose gradient with respect to x is `grad(dy, *saved)` (the rest are constants to it)."""
    def decorate(f):
        @functools.wraps(f)
        def with_gradient(x, *rest):
            @tf.custom_gradient
            def run(x):
                y, saved = f(x, *rest)
                return y, lambda dy: grad(dy, *saved)
            return run(x)
        return with_gradient
    return decorate


@tf.function(jit_compile=True, reduce_retracing=True)
def gelu_grad(dy, x):
    """dy * gelu'(x), in float32, as one XLA program (gradients run in training, where the
    shapes stay the same, so it is compiled once)."""
    x32 = tf.cast(x, tf.float32)
    t = tf.tanh(np.sqrt(2 / np.pi) * (x32 + 0.044715 * x32 * x32 * x32))
    slope = 0.5 * (1 + t) + 0.5 * x32 * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x32 * x32)
    return tf.cast(tf.cast(dy, tf.float32) * slope, dy.dtype)


def normalize_grad(dy, y, r):
    """The gradient of y = (x - mean) * r, r = rsqrt(variance + epsilon), materialized once
    per norm (autodiff's cheap pieces are fused, recomputed, into every block below)."""
    return r * (dy - tf.reduce_mean(dy, axis=-1, keepdims=True)
                - y * tf.reduce_mean(dy * y, axis=-1, keepdims=True))


@tf.function(jit_compile=True, reduce_retracing=True)
def attn_probs_grad(dy, y, mask_scale):
    """The gradient of the attention probabilities y = softmax(mask(w) * scale),
    y * (dy - sum(dy * y)) * mask * scale, as one XLA program (as `gelu_grad`); outside XLA
    autodiff's is seven operations over each [batch, heads, T, T] tensor."""
    g = tf.cast(dy, tf.float32)
    return tf.cast(y * (g - tf.reduce_sum(g * y, axis=-1, keepdims=True)) * mask_scale, dy.dtype)


@tf.function(jit_compile=True, reduce_retracing=True)
def log_sum_exp_less_label(logits, labels):
    """(log-sum-exp of the logits, that less the label's logit) per position, in float32."""
    x = tf.cast(logits, tf.float32)
    lse = tf.reduce_logsumexp(x, axis=-1)
    return lse, lse - tf.gather(x, labels, batch_dims=len(labels.shape))


@tf.function(jit_compile=True, reduce_retracing=True)
def token_losses_grad(dy, logits, lse, labels):
    """dy * (softmax(logits) - one_hot(labels)), in the logits' dtype. Outside XLA autodiff's
    gradient of the label's logit is a scatter into a zeroed [positions, n_vocab] tensor."""
    probs = tf.exp(tf.cast(logits, tf.float32) - lse[..., None])
    return tf.cast((probs - tf.one_hot(labels, tf.shape(logits)[-1], dtype=tf.float32)) * dy[..., None], logits.dtype)


@written(token_losses_grad)
def cross_entropy(logits, labels):
    """Softmax cross-entropy of each position against `labels` (each in [0, n_vocab)), in
    float32 whatever the logits' dtype, each direction one XLA program (inlined in an XLA step)."""
    lse, losses = log_sum_exp_less_label(logits, labels)
    return losses, (logits, lse, labels)


def recompute(block):
    """`block(h) -> (h, present)` that keeps only its input h for the backward pass and runs
    again there. Unlike `tf.recompute_grad`, the rerun reads the incoming gradient (h plus
    0 * a slice of it: XLA cannot fold a float times 0, which is NaN for inf), so that XLA can
    neither merge it with the forward pass (common subexpression elimination) nor schedule it
    early: the saving holds under XLA too. (An optimization barrier does the first, but XLA's
    CPU compiler drops barriers before it schedules.)"""
    @tf.custom_gradient
    def run(h):
        def grad(dh, dpresent, variables=()):
            h_again = h + 0 * dh[..., :1]
            with tf.GradientTape() as tape:
                tape.watch(h_again)
                again = block(h_again)
            grads = tape.gradient(again, [h_again, *variables], output_gradients=[dh, dpresent])
            return grads[0], grads[1:]
        return block(h), grad
    return run
