"""What Keras' `fit` and `evaluate` hand a loss: the logits, not the model's output dict."""


class Fit:
    """`model.compile(loss=...)` with a plain Keras loss (`SparseCategoricalCrossentropy(
    from_logits=True)`, `tfgpt2.train.losses.lm_loss`): the loss sees the logits alone
    (`present` is never built in a compiled step whose outputs do not use it); a loss keyed
    'logits' still works."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, y, self._logits_for_loss(y_pred), sample_weight, training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, self._logits_for_loss(y_pred), sample_weight)

    def _logits_for_loss(self, y_pred):
        return y_pred["logits"] if isinstance(y_pred, dict) and not isinstance(self.loss, dict) else y_pred
