"""TensorFloat-32: whether a layer's float32 products may run in it (`products.matmul`'s `tf32`)."""


class TF32:
    """`tf32`: False (full float32 on every device) unless `allow_tf32` says otherwise."""

    tf32 = False

    def allow_tf32(self, allowed=True):
        """Set `tf32` on this layer and every layer inside it."""
        for layer in self._flatten_layers():
            if isinstance(layer, TF32):
                layer.tf32 = bool(allowed)
