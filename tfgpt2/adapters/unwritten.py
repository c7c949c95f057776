"""A model built for a checkpoint to be loaded into: its variables left unwritten."""
import keras
import tensorflow as tf


class Unwritten:
    """`normal(stddev)`: the original's random_normal_initializer, or, once `leave_unwritten`,
    `uninitialized` (random init of 124M parameters takes seconds and memory for nothing)."""

    initialize = True

    def leave_unwritten(self, unwritten=True):
        """Leave the variables of this layer and every layer inside it unwritten when built (or not)."""
        for layer in self._flatten_layers():
            if isinstance(layer, Unwritten):
                layer.initialize = not unwritten

    def normal(self, stddev):
        return keras.initializers.RandomNormal(stddev=stddev) if self.initialize else uninitialized


def uninitialized(shape, dtype=None):
    """Memory never written, so never resident until loading writes it, a block of rows at a
    time (`checkpoint.load_weights`): a load peaks at the weights plus one block."""
    return tf.raw_ops.Empty(shape=shape, dtype=dtype or "float32", init=False)
