"""The optimizers of `--optimizer`: Adam as TensorFlow 1's `AdamOptimizer` (the forks'),
AdamW, SGD and a leaner Adafactor, with the learning-rate schedule of `--lr_schedule`."""
import math

import tensorflow as tf
import keras

OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")


class Schedule(keras.optimizers.schedules.LearningRateSchedule):
    """`learning_rate` after `warmup_steps` of linear warmup; with 'cosine', then down to a
    tenth of it at `total_steps` (as nanoGPT)."""

    def __init__(self, learning_rate, kind="constant", warmup_steps=0, total_steps=0):
        self.learning_rate, self.kind = learning_rate, kind
        self.warmup_steps, self.total_steps = warmup_steps, total_steps

    def __call__(self, step):  # step: updates applied so far
        step = tf.cast(step, tf.float32)
        lr = tf.constant(self.learning_rate, tf.float32)
        if self.kind == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            lr = lr * (0.1 + 0.9 * 0.5 * (1 + tf.cos(math.pi * progress)))
        if self.warmup_steps:
            lr = lr * tf.minimum(1.0, (step + 1) / self.warmup_steps)
        return lr

    def get_config(self):
        return dict(learning_rate=self.learning_rate, kind=self.kind,
                    warmup_steps=self.warmup_steps, total_steps=self.total_steps)


def _rms(x):
    return tf.sqrt(tf.reduce_mean(tf.square(x)))


class _ApplyAdam:
    """Keras' Adam update as one `ResourceApplyAdam`, the kernel of TensorFlow 1's AdamOptimizer
    (the forks'): the same arithmetic, in place. Keras' dozen ops per weight each make a
    weight-sized tensor outside XLA, and compile slower under it (124M at 4 x 128 tokens: the
    first step 3 s longer with XLA, and without it 10% fewer tokens/s)."""

    def update_step(self, gradient, variable, learning_rate):
        if self.amsgrad:  # the kernel has no maximum of past velocities
            return super().update_step(gradient, variable, learning_rate)
        i = self._get_variable_index(variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=self._momentums[i].value.handle, v=self._velocities[i].value.handle,
            beta1_power=self.beta_1 ** step, beta2_power=self.beta_2 ** step, lr=tf.cast(learning_rate, dtype),
            beta1=tf.constant(self.beta_1, dtype), beta2=tf.constant(self.beta_2, dtype),
            epsilon=tf.constant(self.epsilon, dtype), grad=tf.cast(gradient, dtype))


class Adam(_ApplyAdam, keras.optimizers.Adam):
    """Keras' Adam, each weight updated by `ResourceApplyAdam`."""


class AdamW(_ApplyAdam, keras.optimizers.AdamW):
    """Keras' AdamW (its decay applied first, as Keras does), then `ResourceApplyAdam`."""


class Adafactor(keras.optimizers.Adafactor):
    """Keras' Adafactor without its full-size `velocity` for matrices: there it is always the
    outer product of the factored row and column statistics, so each update recomputes it
    instead of storing it (one float per weight less: 6.2 GB for 1558M). The same updates."""

    def build(self, var_list):
        if self.built:
            return
        super(keras.optimizers.Adafactor, self).build(var_list)  # the base optimizer's
        self._r, self._c, self._v = [], [], []
        for var in var_list:
            factored = len(var.shape) >= 2
            self._r.append(self.add_variable(shape=var.shape[:-1], dtype=var.dtype, name=var.name)
                           if factored else None)
            self._c.append(self.add_variable(shape=var.shape[:-2] + (var.shape[-1],), dtype=var.dtype,
                                             name=var.name) if factored else None)
            self._v.append(None if factored else
                           self.add_variable_from_reference(reference_variable=var, name="velocity"))

    def update_step(self, gradient, variable, learning_rate):
        i = self._get_variable_index(variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        rho = tf.minimum(tf.cast(learning_rate, dtype), 1 / tf.sqrt(step))  # with or without relative_step
        alpha = tf.maximum(tf.cast(self.epsilon_2, dtype), _rms(variable)) * rho
        decay = 1 - tf.pow(step, tf.cast(self.beta_2_decay, dtype))  # the second moment's weight of the past
        square = tf.square(tf.cast(gradient, dtype)) + tf.cast(self.epsilon_1, dtype)
        if self._v[i] is None:
            r, c = self._r[i], self._c[i]
            self.assign(r, decay * r + (1 - decay) * tf.reduce_mean(square, axis=-1))
            self.assign(c, decay * c + (1 - decay) * tf.reduce_mean(square, axis=-2))
            v = (r / tf.reduce_mean(r, axis=-1, keepdims=True))[..., None] * tf.expand_dims(c, -2)
        else:
            v = self._v[i]
            self.assign(v, decay * v + (1 - decay) * square)
        update = tf.cast(gradient, dtype) / tf.sqrt(v)
        update = update / tf.maximum(tf.cast(1, dtype), _rms(update) / tf.cast(self.clip_threshold, dtype))
        self.assign_sub(variable, alpha * update)


def make_optimizer(name, learning_rate, *, lr_schedule="constant", warmup_steps=0, total_steps=0,
                   clip_norm=0.0, weight_decay=0.0, variables=()):
    """A Keras optimizer. 'adam' is TensorFlow 1's AdamOptimizer (the forks'): beta1 0.9,
    beta2 0.999, and epsilon 1e-8 added to sqrt(v) with lr * sqrt(1 - beta2^t) / (1 - beta1^t).
    `weight_decay` is decoupled (as AdamW) and spares biases and norm gains."""
    if lr_schedule != "constant" or warmup_steps:
        learning_rate = Schedule(learning_rate, lr_schedule, warmup_steps, total_steps)
    common = dict(learning_rate=learning_rate, global_clipnorm=clip_norm or None,
                  weight_decay=weight_decay or None)
    optimizer = {
        "adam": lambda: Adam(beta_1=0.9, beta_2=0.999, epsilon=1e-8, **common),
        "adamw": lambda: AdamW(beta_1=0.9, beta_2=0.999, epsilon=1e-8, **common),
        "sgd": lambda: keras.optimizers.SGD(**common),
        "adafactor": lambda: Adafactor(**common),
    }[name]()
    if weight_decay:
        optimizer.exclude_from_weight_decay(var_list=[v for v in variables if len(v.shape) < 2])
    return optimizer


def trained_variables(model, only_transformer_layers=False):
    """All trainable variables, or, as the forks' --only_train_transformer_layers, the blocks'
    (`model/h<i>/...`): not wte, wpe or ln_f."""
    variables = model.trainable_variables
    return [v for v in variables if "/h" in v.path] if only_transformer_layers else variables
