"""What the layers need to be Keras layers beside their math: a config (`get_config`, from the
constructor's arguments that `CONFIG` names, which the layer keeps as attributes of the same
names), the building of their sublayers, and an output shape."""
import keras

from ..hparams import HParams


class Config:
    """A layer's config: its `CONFIG` attributes (HParams as their dict) beside Keras' own."""

    CONFIG = ()

    def get_config(self):
        values = {name: getattr(self, name) for name in self.CONFIG}
        return {**super().get_config(), **{name: v.values() if isinstance(v, HParams) else v
                                           for name, v in values.items()}}


class Layer(Config, keras.layers.Layer):
    """A Keras layer with its `Config`, which builds its sublayers in the order it made them
    (each knows its shapes from its arguments), and whose output has its input's shape unless it
    says otherwise."""

    def build(self, input_shape=None):
        for layer in self._flatten_layers(include_self=False, recursive=False):
            layer.build(input_shape)

    def compute_output_shape(self, input_shape):
        return input_shape
