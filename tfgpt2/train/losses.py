"""The forks' training loss: the softmax cross-entropy of each position's logits against the
next token, in float32 whatever the logits' dtype, its gradient written out
(`gradients.cross_entropy`). `lm_loss` is a plain Keras loss for `model.compile`/`fit`."""
import numpy as np
import tensorflow as tf

from ..gradients import cross_entropy
from ..inputs import in_vocabulary


def token_losses(labels, logits):
    """Softmax cross-entropy of each position. NaN for a label outside [0, n_vocab), which
    `tf.gather` would clamp under XLA."""
    labels = tf.cast(labels, tf.int32)
    ok = in_vocabulary(labels, tf.shape(logits)[-1])
    return tf.where(ok, cross_entropy(logits, tf.where(ok, labels, 0)), np.nan)


def lm_loss(labels, logits):
    """The forks' loss: the mean cross-entropy of each position's logits against the next token
    (`labels` = tokens[:, 1:] for logits of tokens[:, :-1])."""
    return tf.reduce_mean(token_losses(labels, logits))


def window_loss(model, tokens):
    """The loss of windows [batch, length]: the model reads length - 1 tokens and predicts the
    next of each (the forks read all `length` and drop the last position's logits: the same)."""
    return lm_loss(tokens[:, 1:], model(tokens[:, :-1])["logits"])
