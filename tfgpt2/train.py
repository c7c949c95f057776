"""Fine-tuning OpenAI's GPT-2 checkpoints: the forks' `train.py`, in TensorFlow 2 / Keras 3.

    python -m tfgpt2.train --dataset corpus.txt --model_name 124M --steps 1000 --run_name run1

It reads like nanoGPT's `train.py`: data, step, log, evaluate, save. The forks' flags and
defaults leave their update rule unchanged (Adam as TensorFlow 1's `AdamOptimizer`, epsilon
1e-8, learning rate 2e-5, batch 1, windows of 1024 tokens); unlike them, accumulated gradients
are averaged, validation uses data never trained on, and the optimizer state is saved with
each checkpoint so that a resumed run continues exactly.

The run folder `checkpoint/<run_name>/` is gpt-2-simple's: `model-<step>.*` in OpenAI's
variable layout (OpenAI's code and `tfgpt2.load_model` restore it), `checkpoint`, `counter`,
`hparams.json`, `encoder.json`, `vocab.bpe`, TensorBoard events; and `optimizer-<step>.*`
beside the latest model, `best.json` where validation runs, `samples-<step>.txt`.
"""
import argparse
import contextlib
import glob
import json
import math
import os
import shutil
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
from tensorflow.core.framework import summary_pb2  # noqa: E402
from tqdm import tqdm  # noqa: E402

from . import data, distribute  # noqa: E402
from .checkpoint import checkpoint_prefix, load_model, save_tensors, write_atomic  # noqa: E402
from .encoder import ASSETS_DIR, VOCAB_FILES, get_encoder  # noqa: E402
from .hparams import load_hparams, save_hparams  # noqa: E402
from .sample import generate  # noqa: E402

OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")


# ---- loss and step ----------------------------------------------------------------------

def token_losses(labels, logits):
    """Softmax cross-entropy of each position, in float32 whatever the logits' dtype: the
    log-sum-exp of the logits less the label's logit, with the gradient written out (softmax
    less one-hot), each one XLA program (as `model.gelu`'s gradient; inlined in an XLA step).
    Outside XLA autodiff's gradient of the label's logit is a scatter into a zeroed
    [positions, n_vocab] tensor, then added to the softmax's: 80 ms of a 4 x 128 step against 30.
    NaN for a label outside [0, n_vocab), which `tf.gather` would clamp under XLA."""
    labels = tf.cast(labels, tf.int32)
    ok = tf.logical_and(labels >= 0, labels < tf.shape(logits)[-1])
    labels = tf.where(ok, labels, 0)

    @tf.custom_gradient
    def run(logits):
        lse, losses = log_sum_exp_less_label(logits, labels)
        return losses, lambda dy: token_losses_grad(dy, logits, lse, labels)
    return tf.where(ok, run(logits), np.nan)


@tf.function(jit_compile=True, reduce_retracing=True)
def log_sum_exp_less_label(logits, labels):
    """(log-sum-exp of the logits, that less the label's logit) per position, in float32."""
    x = tf.cast(logits, tf.float32)
    lse = tf.reduce_logsumexp(x, axis=-1)
    return lse, lse - tf.gather(x, labels, batch_dims=len(labels.shape))


@tf.function(jit_compile=True, reduce_retracing=True)
def token_losses_grad(dy, logits, lse, labels):
    """dy * (softmax(logits) - one_hot(labels)), in the logits' dtype."""
    probs = tf.exp(tf.cast(logits, tf.float32) - lse[..., None])
    return tf.cast((probs - tf.one_hot(labels, tf.shape(logits)[-1], dtype=tf.float32)) * dy[..., None], logits.dtype)


def lm_loss(labels, logits):
    """The forks' loss: the mean cross-entropy of each position's logits against the next token
    (`labels` = tokens[:, 1:] for logits of tokens[:, :-1]). A plain Keras loss for `fit`."""
    return tf.reduce_mean(token_losses(labels, logits))


def window_loss(model, tokens):
    """The loss of windows [batch, length]: the model reads length - 1 tokens and predicts the
    next of each (the forks read all `length` and drop the last position's logits: the same)."""
    return lm_loss(tokens[:, 1:], model(tokens[:, :-1])["logits"])


class Trainer:
    """The compiled steps for a model, an optimizer and the variables it trains.

    `step(tokens)` takes the windows of one update, [accumulate * batch, length] per replica,
    splits them into `accumulate` micro-batches, averages their gradients and applies them.
    Built under `strategy`'s scope; the batches come from `trainer.distribute(dataset)`.
    """

    def __init__(self, model, optimizer, *, variables=None, accumulate=1, strategy=None, jit_compile=True):
        self.model, self.optimizer, self.accumulate = model, optimizer, accumulate
        self.strategy = strategy or tf.distribute.get_strategy()
        self.variables = list(variables if variables is not None else model.trainable_variables)
        with self.strategy.scope():
            optimizer.build(self.variables)
            # with accumulation, each replica's sums of its micro-batches' gradients
            self._sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                      synchronization=tf.VariableSynchronization.ON_READ,
                                      aggregation=tf.VariableAggregation.SUM)
                          for v in self.variables] if accumulate > 1 else []
        # XLA compiles the forward and backward passes, and on a single device the update too
        # (unfused, Keras' optimizers read and write each weight several times). With replicas
        # the update runs outside XLA, where the optimizer reaches every replica's copy of the
        # variables, and each compiled function is called from a plain per-replica function
        # (which places it on that replica's device).
        fuse_update = jit_compile and self.strategy.num_replicas_in_sync == 1
        self._gradients = (self._accumulated_gradients if fuse_update
                           else tf.function(self._accumulated_gradients, jit_compile=jit_compile))
        replica_step = tf.function(self._replica_step, jit_compile=True) if fuse_update else self._replica_step
        self._window_loss = tf.function(lambda tokens: window_loss(model, tokens), jit_compile=jit_compile)
        self._step = tf.function(lambda batch: self._mean(replica_step, batch))
        self._loss = tf.function(lambda batch: self._mean(lambda tokens: self._window_loss(tokens), batch))

    def _mean(self, fn, batch):
        return self.strategy.reduce("MEAN", self.strategy.run(fn, args=(batch,)), axis=None)

    def _loss_and_gradients(self, tokens, share=1):
        """The loss of `tokens` and the gradients of `share` of it."""
        with tf.GradientTape() as tape:
            loss = window_loss(self.model, tokens)
            scaled = loss * share / self.strategy.num_replicas_in_sync  # the optimizer sums over replicas
            scaled = self.optimizer.scale_loss(scaled)  # float16's loss scale; 1 otherwise
        return loss, [tf.convert_to_tensor(g) for g in tape.gradient(scaled, self.variables)]

    def _accumulated_gradients(self, tokens):
        """The mean loss and gradients of `accumulate` micro-batches of `tokens`."""
        if self.accumulate == 1:
            # No loop: XLA keeps even one that never runs, and gradients carried through it
            # fuse neither with their producers nor into the update (124M at 4 x 128 tokens:
            # 0.4 GB more peak memory, 4 s more compiling).
            return self._loss_and_gradients(tokens)
        # Each micro-batch's share of the mean gradients is added to variables as it comes: a
        # loop carrying the sums as tensors held about two sets of gradients more.
        micro = tf.reshape(tokens, [self.accumulate, -1, tokens.shape[-1]])
        loss = tf.constant(0.0)
        for i in tf.range(self.accumulate):
            more_loss, grads = self._loss_and_gradients(micro[i], share=1 / self.accumulate)
            loss += more_loss
            if i == 0:  # rather than zeroing them before the loop: `zeros_like` held a set more
                for total, g in zip(self._sums, grads):
                    total.assign(g)
            else:
                for total, g in zip(self._sums, grads):
                    total.assign_add(g)
        return loss / self.accumulate, [total.read_value() for total in self._sums]

    def _replica_step(self, tokens):
        loss, grads = self._gradients(tokens)
        self.optimizer.apply_gradients(zip(grads, self.variables))
        return loss

    def distribute(self, dataset):
        """Each replica's share of every global batch of `dataset`."""
        return distribute.shard(self.strategy, dataset)

    def step(self, batch):
        """One update; returns the mean loss over the batch."""
        return self._step(batch)

    def loss(self, batch):
        return self._loss(batch)


# ---- optimizer --------------------------------------------------------------------------

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


# ---- run folder -------------------------------------------------------------------------

def _step_of(prefix):
    """The step in a `model-<step>` prefix, else the `counter` beside it (gpt-2-simple's), else 0."""
    tail = os.path.basename(prefix).rsplit("-", 1)[-1]
    if tail.isdigit():
        return int(tail)
    counter = os.path.join(os.path.dirname(prefix), "counter")
    return int(open(counter).read().strip() or 0) if os.path.isfile(counter) else 0


def checkpoint_steps(run_dir):
    """Steps of the model-<step> checkpoints the run folder's `checkpoint` file names."""
    state = tf.train.get_checkpoint_state(run_dir)
    paths = state.all_model_checkpoint_paths if state else []
    return [_step_of(p) for p in paths]


def save_run(run_dir, model, optimizer, step, *, max_checkpoints=1, keep=()):
    """Save step `step`: optimizer state, then the weights, then the `checkpoint` file that
    names them (so an interrupt never leaves a half-written checkpoint named there) and
    `counter`. Older checkpoints beyond `max_checkpoints` go, except the steps in `keep`;
    optimizer state is kept for the latest only."""
    save_tensors(run_dir, f"optimizer-{step}",
                 {f"optimizer/{i}": v for i, v in enumerate(optimizer_state(optimizer))})
    save_tensors(run_dir, f"model-{step}", {v.path: v for v in model.weights})
    steps = sorted(set(checkpoint_steps(run_dir)) - {step}) + [step]
    kept = [s for i, s in enumerate(steps) if i >= len(steps) - max_checkpoints or s in keep]
    lines = [f'model_checkpoint_path: "model-{step}"']
    lines += [f'all_model_checkpoint_paths: "model-{s}"' for s in kept]
    write_atomic(os.path.join(run_dir, "checkpoint"), "\n".join(lines) + "\n")
    write_atomic(os.path.join(run_dir, "counter"), f"{step}\n")
    for path in glob.glob(os.path.join(run_dir, "model-*.*")) + glob.glob(os.path.join(run_dir, "optimizer-*.*")):
        kind, s = os.path.basename(path).split(".")[0].split("-")
        if int(s) not in kept or (kind == "optimizer" and int(s) != step):
            os.remove(path)


def optimizer_state(optimizer):
    """The optimizer's variables but its learning rate, which comes from the flags."""
    return [v for v in optimizer.variables if v.name != "learning_rate"]


def restore_optimizer(optimizer, run_dir, step):
    """Optimizer state from `optimizer-<step>` beside the weights; False where there is none."""
    prefix = os.path.join(run_dir, f"optimizer-{step}")
    if not os.path.isfile(prefix + ".index"):
        return False
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    state = optimizer_state(optimizer)
    if len(shapes) != len(state):
        raise ValueError(f"{prefix}: holds {len(shapes)} optimizer variables, this optimizer has "
                         f"{len(state)} (another --optimizer or --only_train_transformer_layers?)")
    for i, variable in enumerate(state):
        value = reader.get_tensor(f"optimizer/{i}")
        if list(value.shape) != list(variable.shape):
            raise ValueError(f"{prefix}: optimizer/{i} ({variable.path}) has shape {list(value.shape)}, "
                             f"expected {list(variable.shape)}")
        variable.assign(value)
    return True


def find_start(args):
    """Where the run starts: (run folder, folder of the weights, checkpoint prefix or None,
    step, hparams), from the run folder (--restore_from latest), the base model (fresh, or
    latest in a new run) or a path. Checks only; nothing is loaded or written."""
    run_dir = os.path.join(args.checkpoint_dir, args.run_name)
    has_checkpoint = os.path.isfile(os.path.join(run_dir, "checkpoint"))
    if args.restore_from == "latest" and has_checkpoint:
        source, prefix = run_dir, checkpoint_prefix(run_dir)
        step = _step_of(prefix)
    elif args.restore_from in ("latest", "fresh"):
        if has_checkpoint:
            raise ValueError(f"{run_dir} already holds checkpoints (the latest: "
                             f"{tf.train.latest_checkpoint(run_dir)}); continue it with --restore_from latest, "
                             "or choose another --run_name")
        source, prefix, step = os.path.join(args.models_dir, args.model_name), None, 0
    else:
        if not os.path.isdir(args.restore_from) and not os.path.isfile(args.restore_from + ".index"):
            raise FileNotFoundError(f"--restore_from {args.restore_from}: no such folder or checkpoint prefix")
        source = args.restore_from if os.path.isdir(args.restore_from) else os.path.dirname(args.restore_from)
        prefix, step = checkpoint_prefix(args.restore_from), 0
    hparams = load_hparams(source)
    if os.path.isfile(os.path.join(run_dir, "hparams.json")) and load_hparams(run_dir) != hparams:
        raise ValueError(f"{run_dir}/hparams.json is {load_hparams(run_dir).values()}, but the model to "
                         f"start from ({source}) has {hparams.values()}")
    if 0 <= args.steps < step:
        raise ValueError(f"{run_dir} is at step {step}, past --steps {args.steps}: --steps is the run's "
                         f"total, not a number of steps more (for N more: --steps {step} + N)")
    return run_dir, source, prefix, step, hparams


def vocabulary_dir(*folders):
    """The first folder holding encoder.json and vocab.bpe; else the copy shipped with tfgpt2."""
    for folder in folders:
        if all(os.path.isfile(os.path.join(folder, name)) for name in VOCAB_FILES):
            return folder
    return ASSETS_DIR


def write_run_files(run_dir, hparams, vocab_dir):
    """hparams.json, and encoder.json and vocab.bpe from `vocab_dir`."""
    os.makedirs(run_dir, exist_ok=True)
    save_hparams(hparams, run_dir)
    for name in VOCAB_FILES:
        src, dst = os.path.join(vocab_dir, name), os.path.join(run_dir, name)
        if not os.path.isfile(dst):
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)


# ---- the loop ---------------------------------------------------------------------------

def load_data(args, enc, hparams):
    """(training windows, validation batches or None), and the window length."""
    length = args.sample_length + 1
    chunks = data.load_dataset(enc, args.dataset, combine=args.combine, encoding=args.encoding,
                               n_vocab=hparams.n_vocab)
    _check_ids(chunks, hparams.n_vocab, args.dataset)
    val = None
    if args.val_dataset:
        val_chunks = data.load_dataset(enc, args.val_dataset, combine=args.combine, encoding=args.encoding,
                                       n_vocab=hparams.n_vocab)
        val = data.Windows(val_chunks, length, name=args.val_dataset)
    elif args.val_every > 0:
        chunks, val_chunks = data.split_validation(chunks, args.val_fraction)
        val = data.Windows(val_chunks, length, name=f"{args.dataset} (the held-out last "
                                                    f"--val_fraction {args.val_fraction})")
    train = data.Windows(chunks, length, name=args.dataset)
    val_batches = val and data.fixed_batches(val, batch_size=args.val_batch_size, count=args.val_batch_count)
    return train, val_batches


def _check_ids(chunks, n_vocab, name):
    top = max(int(c.max()) for c in chunks if c.size) if any(c.size for c in chunks) else 0
    if top >= n_vocab:
        raise data.DatasetError(f"{name}: token id {top} is outside [0, n_vocab={n_vocab})")


def build_trainer(args, strategy, source, prefix):
    """(model, optimizer, Trainer) as the flags say, the model's weights from `prefix`, the
    model and the optimizer's state made in the strategy's scope."""
    with strategy.scope():
        model = load_model(source, checkpoint=prefix, dtype=args.precision)
    model.remat = args.remat
    variables = trained_variables(model, args.only_train_transformer_layers)
    with strategy.scope():
        optimizer = make_optimizer(args.optimizer, args.learning_rate, lr_schedule=args.lr_schedule,
                                   warmup_steps=args.warmup_steps, total_steps=args.steps,
                                   clip_norm=args.clip_norm, weight_decay=args.weight_decay,
                                   variables=variables)
        if args.precision == "mixed_float16":  # dynamic loss scaling; a step with inf or NaN is skipped
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    trainer = Trainer(model, optimizer, variables=variables, accumulate=args.accumulate_gradients,
                      strategy=strategy, jit_compile=not args.no_xla)
    return model, optimizer, trainer


def train(args, strategy=None):
    """Fine-tune as the flags say; returns the list of (step, loss) of this run's updates."""
    strategy = strategy or tf.distribute.get_strategy()
    distribute.check_batch(args.batch_size, strategy)
    chief = distribute.is_chief(strategy)  # the one process that writes the run folder
    run_dir, source, prefix, step, hp = find_start(args)
    if step == args.steps:
        tqdm.write(f"{run_dir} has made its --steps {step} updates already: nothing to train")
        return []
    args.sample_length = args.sample_length or hp.n_ctx - 1
    if args.sample_length > hp.n_ctx:
        raise ValueError(f"--sample_length {args.sample_length} exceeds the model's context n_ctx={hp.n_ctx}")
    vocab_dir = vocabulary_dir(source, os.path.join(args.models_dir, args.model_name))
    enc = get_encoder(os.path.basename(vocab_dir), os.path.dirname(vocab_dir))
    windows, val_batches = load_data(args, enc, hp)
    model, optimizer, trainer = build_trainer(args, strategy, source, prefix)
    if chief:
        write_run_files(run_dir, hp, vocab_dir)
    if step and not restore_optimizer(optimizer, run_dir, step):
        tqdm.write(f"{run_dir}: no optimizer state for step {step}; the optimizer starts afresh")
    optimizer.iterations.assign(step)

    per_step = args.batch_size * args.accumulate_gradients  # in all, split over the replicas
    dataset = data.training_dataset(windows, batch_size=per_step, seed=args.seed, start_step=step, steps=args.steps)
    best = _read_best(run_dir)
    writer = tf.summary.create_file_writer(run_dir) if chief else tf.summary.create_noop_writer()
    history, avg = [], [0.0, 0.0]
    bar = tqdm(initial=step, total=args.steps if args.steps > 0 else None, unit="step",
               disable=not sys.stderr.isatty())

    def save():
        if not chief:
            return
        with _no_interrupts():
            save_run(run_dir, model, optimizer, step, max_checkpoints=args.max_checkpoints,
                     keep={best["step"]} if best else ())
            if best and best["step"] == step:
                write_atomic(os.path.join(run_dir, "best.json"), json.dumps(best) + "\n")
        tqdm.write(f"Saving {run_dir}/model-{step}")

    saved = step
    try:
        batches = iter(trainer.distribute(dataset))
        while args.steps < 0 or step < args.steps:
            start = time.perf_counter()
            loss = float(trainer.step(next(batches)))
            step += 1
            seconds = time.perf_counter() - start
            history.append((step, loss))
            avg = [avg[0] * 0.99 + loss, avg[1] * 0.99 + 1]
            lr = _current_lr(optimizer)
            tokens_per_s = per_step * args.sample_length / seconds
            _log(writer, step, loss=loss, learning_rate=lr, tokens_per_second=tokens_per_s)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", avg=f"{avg[0] / avg[1]:.4f}", tok_s=f"{tokens_per_s:.0f}",
                            lr=f"{lr:.3g}")
            if bar.disable and args.print_every and step % args.print_every == 0:
                print(f"[{step} | {seconds:.2f}s] loss={loss:.4f} avg={avg[0] / avg[1]:.4f} "
                      f"tokens/s={tokens_per_s:.0f} lr={lr:.3g}", flush=True)
            if args.val_every > 0 and step % args.val_every == 0:
                val_loss = validate(trainer, val_batches)
                _log(writer, step, val_loss=val_loss, val_perplexity=math.exp(val_loss))
                tqdm.write(f"[{step}] validation loss={val_loss:.4f} perplexity={math.exp(val_loss):.2f}")
                if best is None or val_loss < best["val_loss"]:
                    best = {"step": step, "val_loss": val_loss}
                    save()
                    saved = step
            if args.save_every > 0 and step % args.save_every == 0 and saved != step:
                save()
                saved = step
            if args.sample_every > 0 and step % args.sample_every == 0 and chief:
                write_samples(model, enc, args, run_dir, step)
    except KeyboardInterrupt:
        tqdm.write("interrupted")
    finally:
        bar.close()
        writer.close()
    if saved != step:
        save()
    return history


@contextlib.contextmanager
def _no_interrupts():
    """Ctrl-C waits until the block (writing a checkpoint) is done, then takes effect."""
    pending = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    except ValueError:  # not the main thread: signals go elsewhere anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def validate(trainer, batches):
    """The mean loss over the validation batches [count, batch, length], each split over the replicas."""
    dataset = trainer.distribute(tf.data.Dataset.from_tensor_slices(batches))
    return float(np.mean([float(trainer.loss(batch)) for batch in dataset]))


def write_samples(model, enc, args, run_dir, step):
    """`--sample_num` samples of `--sample_length` tokens from <|endoftext|>, printed and written
    to samples-<step>.txt."""
    rows = generate(model, [[enc.eot_token]] * args.sample_num, args.sample_length, top_k=args.top_k,
                    seed=args.seed + step)
    text = "".join("=" * 20 + f" SAMPLE {i} " + "=" * 20 + "\n" + enc.decode(row[1:]) + "\n"
                   for i, row in enumerate(rows))
    tqdm.write(text)
    write_atomic(os.path.join(run_dir, f"samples-{step}.txt"), text)


def _current_lr(optimizer):
    return float(tf.convert_to_tensor(optimizer.learning_rate))  # the schedule's value where there is one


def _log(writer, step, **scalars):
    """TensorBoard scalars, as `tf.summary.scalar` writes them (which needs tensorboard installed)."""
    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    with writer.as_default():
        for name, value in scalars.items():
            tf.summary.write(name, tf.constant(value, tf.float32), step=step, metadata=metadata)


def _read_best(run_dir):
    path = os.path.join(run_dir, "best.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


# ---- command line -----------------------------------------------------------------------

def _type(kind, minimum=None, maximum=None):
    def parse(text):
        value = kind(text)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    return parse


def parser():
    p = argparse.ArgumentParser(prog="python -m tfgpt2.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--dataset", required=True, help="a text file, a folder, a glob, or an .npz of encoded chunks")
    a("--model_name", default="124M", help="the model to start from: <models_dir>/<model_name>")
    a("--models_dir", default="models")
    a("--combine", type=_type(int, 1), default=50000,
      help="join text files with <|endoftext|> until at least this many characters per chunk")
    a("--encoding", default="utf-8", help="the text files' encoding")
    a("--batch_size", type=_type(int, 1), default=1,
      help="windows per micro-batch in all, split over the replicas of --strategy")
    a("--strategy", choices=distribute.STRATEGIES, default="auto",
      help="auto: several GPUs -> mirrored, TF_CONFIG -> multiworker, else one (see tfgpt2/distribute.py)")
    a("--tpu", help="with --strategy tpu: the TPU's name or grpc:// address (empty on a TPU VM)")
    a("--learning_rate", type=_type(float, 0), default=2e-5)
    a("--optimizer", choices=OPTIMIZERS, default="adam")
    a("--accumulate_gradients", type=_type(int, 1), default=1,
      help="micro-batches per update, their gradients averaged")
    a("--only_train_transformer_layers", action="store_true", help="train the blocks only (not wte, wpe, ln_f)")
    a("--steps", type=_type(int, -1), default=-1,
      help="stop when the run has made this many updates in all (-1: never); rerun the same "
           "command with --restore_from latest to continue an interrupted run exactly")
    a("--run_name", default="run1")
    a("--checkpoint_dir", default="checkpoint")
    a("--restore_from", default="latest",
      help="latest (the run folder's latest checkpoint, else the base model), fresh (the base "
           "model), or a model folder / checkpoint prefix (its weights, from step 0)")
    a("--save_every", type=_type(int, 0), default=1000)
    a("--max_checkpoints", type=_type(int, 1), default=1)
    a("--sample_every", type=_type(int, 0), default=100)
    a("--sample_length", type=_type(int, 1), default=None,
      help="tokens per sample, and the tokens a training window predicts "
           "(a window is sample_length + 1 tokens); default n_ctx - 1 (1023), the forks'")
    a("--sample_num", type=_type(int, 1), default=1)
    a("--top_k", type=_type(int, 0), default=40)
    a("--val_dataset", help="validation data; without it, the last --val_fraction of --dataset is held out")
    a("--val_fraction", type=_type(float, 0, 1), default=0.1)
    a("--val_every", type=_type(int, 0), default=0)
    a("--val_batch_size", type=_type(int, 1), default=2)
    a("--val_batch_count", type=_type(int, 1), default=40)
    a("--print_every", type=_type(int, 0), default=1, help="log lines when stderr is not a terminal")
    a("--no_xla", action="store_true", help="run the step without XLA (compiles faster; on a CPU, 16-bit products: see --precision)")
    a("--seed", type=int, default=0, help="draws the windows (and samples)")
    a("--lr_schedule", choices=("constant", "cosine"), default="constant",
      help="cosine: down to a tenth of --learning_rate at --steps")
    a("--warmup_steps", type=_type(int, 0), default=0)
    a("--clip_norm", type=_type(float, 0), default=0.0, help="clip gradients to this global norm (0: off)")
    a("--weight_decay", type=_type(float, 0), default=0.0, help="decoupled weight decay (AdamW's)")
    a("--precision", choices=("float32", "mixed_bfloat16", "mixed_float16"), default="float32",
      help="mixed_*: float32 weights, matmuls in 16 bits (float16 with dynamic loss scaling); "
           "on a CPU only with --no_xla (XLA's CPU dots are float32), faster where oneDNN's "
           "bfloat16 kernels are")
    a("--remat", action="store_true", help="recompute each block in the backward pass: less memory, more time")
    return p


def parse_args(argv=None, *, exit_on_error=True):
    """The flags; a bad one exits with argparse's usage message, or with `exit_on_error`
    False raises ValueError with it."""
    p = parser()
    if not exit_on_error:
        p.error = _raise
    args = p.parse_args(argv)
    if args.lr_schedule == "cosine" and args.steps < 1:
        p.error("--lr_schedule cosine needs --steps")
    return args


def _raise(message):
    raise ValueError(message)


def finetune(dataset, *, strategy=None, **flags):
    """`python -m tfgpt2.train` from Python, as gpt-2-simple's `finetune` for notebooks: each
    keyword is the flag of that name (True for a switch), e.g.
    `finetune("corpus.txt", model_name="355M", steps=1000, remat=True)`. Returns the (step,
    loss) of each update; Ctrl-C (an interrupted cell) saves and returns. A bad flag raises
    ValueError before anything is loaded or written."""
    argv = ["--dataset", str(dataset)]
    for name, value in flags.items():
        if value is True:
            argv.append(f"--{name}")
        elif value is not None and value is not False:
            argv += [f"--{name}", str(value)]
    return _train_as_flagged(parse_args(argv, exit_on_error=False), strategy)


def _train_as_flagged(args, strategy=None):
    """`train` in the strategy of --strategy unless given one, XLA's scheduler set for --remat."""
    if args.remat:
        prefer_memory_schedule()
    return train(args, strategy or distribute.make_strategy(args.strategy, args.tpu))


def prefer_memory_schedule():
    """Ask XLA's CPU scheduler for its memory-minimizing order. By default it orders for
    concurrency and keeps alive the activations that `--remat` frees. A process-wide flag
    (`XLA_FLAGS`), read at the first XLA compilation: set before any, or it does nothing."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_enable_concurrency_optimized_scheduler=false".strip()


def main(argv=None):
    args = parse_args(argv)
    try:
        _train_as_flagged(args)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    except tf.errors.OpError as e:  # a worker that died, memory, ...
        run_dir = os.path.join(args.checkpoint_dir, args.run_name)
        print(distribute.failure(e, run_dir, checkpoint_steps(run_dir)), file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: TensorFlow's teardown can abort after a failed collective
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
