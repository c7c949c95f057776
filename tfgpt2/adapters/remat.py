"""Rematerialization: a layer that keeps only its input for the backward pass and runs again
there (`gradients.recompute`), through Keras' own hook: `__call__` runs a layer whose
`_remat_mode` is set through `rematerialized_call`."""
import keras

from ..gradients import recompute


class Remat:
    """`remat=True` (a constructor argument): each call is `gradients.recompute(call)`, which,
    unlike Keras' `tf.recompute_grad`, keeps its saving under XLA."""

    def __init__(self, *args, remat=False, **kwargs):
        super().__init__(*args, **kwargs)
        if remat:
            self._remat_mode = keras.RematScope(mode="full")

    def rematerialized_call(self, call, *args, **kwargs):
        return lambda x, *rest, **named: recompute(lambda h: call(h, *rest, **named))(x)
