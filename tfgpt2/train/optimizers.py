"""The optimizers of `--optimizer`: Adam as TensorFlow 1's `AdamOptimizer` (the forks'),
AdamW, SGD and a leaner Adafactor, with the learning-rate schedule of `--lr_schedule`. Built
on Keras' public optimizer API: `build` makes the state, `update_step` applies one gradient."""
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


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _rms(x):
    return tf.sqrt(tf.reduce_mean(tf.square(x)))


class _WithState(keras.optimizers.Optimizer):
    """A Keras optimizer with state per trained variable, made by `make_state(variable)` and
    found by `state(variable)` for the variable `update_step` receives: under tf.distribute,
    one replica's copy, paired here with the same replica's copies of the state."""

    def __init__(self, learning_rate, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self._strategy = tf.distribute.get_strategy()  # as Keras' optimizers: the one updating

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._state_of = {}
        for variable in var_list:
            state = self.make_state(variable)
            for copies in zip(self._copies(variable), *map(self._copies, state)):
                self._state_of[id(copies[0])] = copies[1:]

    def _copies(self, variable):
        """A variable as `update_step` may see it: whole (one device, a TPU), or one replica's."""
        whole = _tf_variable(variable)
        return [whole, *self._strategy.experimental_local_results(whole)]

    def state(self, variable):
        return self._state_of[id(_tf_variable(variable))]

    def make_state(self, variable):
        raise NotImplementedError


class Adam(_WithState):
    """TensorFlow 1's AdamOptimizer (the forks'): each update one `ResourceApplyAdam`, the kernel
    it runs. The same arithmetic as Keras' Adam, in place: Keras' dozen ops per weight each
    make a weight-sized tensor outside XLA, and compile slower under it (124M at 4 x 128
    tokens: the first step 3 s longer with XLA, and without it 10% fewer tokens/s). Keras'
    `weight_decay`, where given, is decoupled (AdamW's), applied before by the base optimizer."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-8, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def make_state(self, variable):
        return (self.add_variable_from_reference(variable, "momentum"),
                self.add_variable_from_reference(variable, "velocity"))

    def update_step(self, gradient, variable, learning_rate):
        m, v = self.state(variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=m.handle, v=v.handle, beta1_power=self.beta_1 ** step,
            beta2_power=self.beta_2 ** step, lr=tf.cast(learning_rate, dtype), beta1=tf.constant(self.beta_1, dtype),
            beta2=tf.constant(self.beta_2, dtype), epsilon=tf.constant(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype))

    def get_config(self):
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon}


class Adafactor(_WithState):
    """Keras' Adafactor without its full-size velocity for matrices: there it is always the
    outer product of the factored row and column statistics, so each update recomputes it
    instead of storing it (one float per weight less: 6.2 GB for 1558M). The same updates."""

    def __init__(self, learning_rate=0.001, beta_2_decay=-0.8, epsilon_1=1e-30, epsilon_2=1e-3,
                 clip_threshold=1.0, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.beta_2_decay, self.epsilon_1, self.epsilon_2 = beta_2_decay, epsilon_1, epsilon_2
        self.clip_threshold = clip_threshold

    def make_state(self, variable):
        """(rows, columns) of the mean squared gradient for a matrix; (velocity,) for a vector."""
        if len(variable.shape) < 2:
            return (self.add_variable_from_reference(variable, "velocity"),)
        name = variable.path.replace("/", "_")
        return (self.add_variable(variable.shape[:-1], dtype=variable.dtype, name=f"{name}_rows"),
                self.add_variable(variable.shape[:-2] + (variable.shape[-1],), dtype=variable.dtype,
                                  name=f"{name}_columns"))

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        gradient = tf.cast(gradient, dtype)
        step = tf.cast(self.iterations + 1, dtype)
        rho = tf.minimum(tf.cast(learning_rate, dtype), 1 / tf.sqrt(step))
        alpha = tf.maximum(tf.cast(self.epsilon_2, dtype), _rms(variable)) * rho
        decay = 1 - tf.pow(step, tf.cast(self.beta_2_decay, dtype))  # the second moment's weight of the past
        square = tf.square(gradient) + tf.cast(self.epsilon_1, dtype)
        state = self.state(variable)
        if len(state) == 2:
            r, c = state
            r.assign(decay * r + (1 - decay) * tf.reduce_mean(square, axis=-1))
            c.assign(decay * c + (1 - decay) * tf.reduce_mean(square, axis=-2))
            v = (r / tf.reduce_mean(r, axis=-1, keepdims=True))[..., None] * tf.expand_dims(c, -2)
        else:
            v, = state
            v.assign(decay * v + (1 - decay) * square)
        update = gradient / tf.sqrt(v)
        update = update / tf.maximum(tf.cast(1, dtype), _rms(update) / tf.cast(self.clip_threshold, dtype))
        variable.assign_sub(alpha * update)

    def get_config(self):
        return {**super().get_config(), "beta_2_decay": self.beta_2_decay, "epsilon_1": self.epsilon_1,
                "epsilon_2": self.epsilon_2, "clip_threshold": self.clip_threshold}


def make_optimizer(name, learning_rate, *, lr_schedule="constant", warmup_steps=0, total_steps=0,
                   clip_norm=0.0, weight_decay=0.0, variables=()):
    """A Keras optimizer. 'adam' is TensorFlow 1's AdamOptimizer (the forks'): beta1 0.9,
    beta2 0.999, and epsilon 1e-8 added to sqrt(v) with lr * sqrt(1 - beta2^t) / (1 - beta1^t).
    `weight_decay` is decoupled (as AdamW) and spares biases and norm gains; 'adamw' is 'adam'
    with Keras' AdamW decay, 0.004, where `weight_decay` is 0."""
    if lr_schedule != "constant" or warmup_steps:
        learning_rate = Schedule(learning_rate, lr_schedule, warmup_steps, total_steps)
    if name == "adamw":
        name, weight_decay = "adam", weight_decay or 0.004
    common = dict(learning_rate=learning_rate, global_clipnorm=clip_norm or None,
                  weight_decay=weight_decay or None)
    optimizer = {
        "adam": lambda: Adam(beta_1=0.9, beta_2=0.999, epsilon=1e-8, **common),
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
