"""The compiled training step: the forks' loss over a batch of windows, gradients averaged
over micro-batches (`--accumulate_gradients`) and replicas (`tf.distribute`), then the update."""
import os

import keras
import tensorflow as tf

from .losses import lm_loss, window_loss
from . import data, distribute


class Trainer:
    """The compiled steps for a model, an optimizer and the variables it trains.

    `step(tokens)` takes the windows of one update, [accumulate * batch, length] per replica,
    splits them into `accumulate` micro-batches, averages their gradients and applies them;
    with `skip_non_finite`, not where the loss or a gradient is not finite: that update is
    skipped and counted in `skipped`. With `noise` (the forks' --noise), each input token is
    replaced by a random one with that probability, drawn from (`seed`, step). Built under
    `strategy`'s scope; the batches come from `trainer.distribute(dataset)`.
    """

    def __init__(self, model, optimizer, *, variables=None, accumulate=1, strategy=None, jit_compile=True,
                 noise=0.0, seed=0, skip_non_finite=False):
        self.model, self.optimizer, self.accumulate = model, optimizer, accumulate
        self.noise, self.seed, self.skip_non_finite = noise, seed, skip_non_finite
        self.strategy = strategy or tf.distribute.get_strategy()
        self.variables = list(variables if variables is not None else model.trainable_variables)
        with self.strategy.scope():
            optimizer.build(self.variables)
            self.skipped = tf.Variable(0, dtype=tf.int64, trainable=False,
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
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
        # Autograph (which rewrites the Python of everything traced, the model's too) only for
        # the micro-batch loop: the rest is plain TensorFlow, traced in about half the time.
        fuse_update = self._fused = jit_compile and self.strategy.num_replicas_in_sync == 1
        loop = accumulate > 1
        self._gradients = (self._accumulated_gradients if fuse_update
                           else tf.function(self._accumulated_gradients, jit_compile=jit_compile, autograph=loop))
        replica_step = (tf.function(self._replica_step, jit_compile=True, autograph=loop) if fuse_update
                        else self._replica_step)
        self._window_loss = tf.function(lambda tokens: window_loss(model, tokens), jit_compile=jit_compile,
                                        autograph=False)
        self._step = tf.function(lambda batch: self._mean(replica_step, batch), autograph=False)
        self._loss = tf.function(lambda batch: self._mean(lambda tokens: self._window_loss(tokens), batch),
                                 autograph=False)

    def _mean(self, fn, batch):
        return self.strategy.reduce("MEAN", self.strategy.run(fn, args=(batch,)), axis=None)

    def _loss_and_gradients(self, tokens, share=1, micro=0):
        """The loss of `tokens` (micro-batch `micro` of the step), and a function that computes
        the gradients of `share` of it."""
        with tf.GradientTape() as tape:
            loss = self._noised_loss(tokens, micro) if self.noise else window_loss(self.model, tokens)
            scaled = loss * share / self.strategy.num_replicas_in_sync  # the optimizer sums over replicas
            scaled = self.optimizer.scale_loss(scaled)  # float16's loss scale; 1 otherwise
        return loss, lambda: [tf.convert_to_tensor(g) for g in tape.gradient(scaled, self.variables)]

    def _noised_loss(self, tokens, micro):
        """The forks' loss with the inputs noised (`data.noised`), the labels as they are; the
        noise drawn from (seed, step, replica, micro-batch), so that a resumed run repeats it."""
        seed = tf.stack([tf.cast(self.seed, tf.int64), tf.cast(self.optimizer.iterations, tf.int64)])
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        for value in (replica, micro):
            seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(value, tf.int64))
        inputs = data.noised(tokens[:, :-1], self.noise, self.model.hparams.n_vocab, seed)
        return lm_loss(tokens[:, 1:], self.model(inputs)["logits"])

    def _accumulated_gradients(self, tokens):
        """The mean loss and gradients of `accumulate` micro-batches of `tokens`."""
        if self.accumulate == 1:
            # No loop: XLA keeps even one that never runs, and gradients carried through it
            # fuse neither with their producers nor into the update (124M at 4 x 128 tokens:
            # 0.4 GB more peak memory, 4 s more compiling).
            loss, gradients = self._loss_and_gradients(tokens)
            return loss, gradients()
        # Each micro-batch's share of the mean gradients is added to variables as it comes: a
        # loop carrying the sums as tensors held about two sets of gradients more.
        micro = tf.reshape(tokens, [self.accumulate, -1, tokens.shape[-1]])
        loss = tf.constant(0.0)
        for i in tf.range(self.accumulate):
            more_loss, gradients = self._loss_and_gradients(micro[i], share=1 / self.accumulate, micro=i)
            loss, grads = loss + more_loss, gradients()
            if i == 0:  # rather than zeroing them before the loop: `zeros_like` held a set more
                for total, g in zip(self._sums, grads):
                    total.assign(g)
            else:
                for total, g in zip(self._sums, grads):
                    total.assign_add(g)
        return loss / self.accumulate, [total.read_value() for total in self._sums]

    def _replica_step(self, tokens):
        if not self.skip_non_finite:
            loss, grads = self._gradients(tokens)
            self.optimizer.apply_gradients(zip(grads, self.variables))
            return loss
        if self._fused and self.accumulate == 1:
            # One program: the backward pass in the branch a finite loss takes, so that each
            # gradient fuses into its weight's update as far as a branch allows (a model of 67M
            # weights peaked 0.16 GB higher than unchecked; gradients made before the branch,
            # 0.2 GB, and checked too, 0.4 GB). A non-finite gradient makes the next loss NaN.
            loss, gradients = self._loss_and_gradients(tokens)
            self._apply_if(tf.math.is_finite(loss), gradients)
            return loss
        loss, grads = self._gradients(tokens)
        finite = tf.math.is_finite(loss)
        if not isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):  # it skips those itself,
            finite &= tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])  # as its scale adjusts
        self._apply_if(finite, lambda: grads)
        return loss

    def _apply_if(self, finite, gradients):
        """The update of `gradients()` where every replica's `finite` holds; else the step is
        skipped, counted in `skipped`, and the optimizer's iterations advance all the same (the
        schedule and a resumed run keep the run's step)."""
        context = tf.distribute.get_replica_context()
        finite = context.all_reduce("SUM", tf.cast(~finite, tf.int32)) == 0  # the same on every replica

        def apply():
            self.optimizer.apply_gradients(zip(gradients(), self.variables))

        def skip():
            self.skipped.assign_add(1)
            self.optimizer.iterations.assign_add(1)

        def across(strategy, ok):  # the optimizer's merge_call is refused inside a replica's cond
            tf.cond(strategy.experimental_local_results(ok)[0],
                    lambda: strategy.extended.call_for_each_replica(apply), skip)

        if self.strategy.num_replicas_in_sync == 1 or tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(finite, apply, skip)
        else:
            context.merge_call(across, args=(finite,))

    def distribute(self, dataset):
        """Each replica's share of every global batch of `dataset`."""
        return distribute.shard(self.strategy, dataset)

    def step(self, batch):
        """One update; returns the mean loss over the batch."""
        return self._step(batch)

    def loss(self, batch):
        return self._loss(batch)


def prefer_memory_schedule():
    """Ask XLA's CPU scheduler for its memory-minimizing order. By default it orders for
    concurrency and keeps alive the activations that `--remat` frees. A process-wide flag
    (`XLA_FLAGS`), read at the first XLA compilation: set before any, or it does nothing."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_enable_concurrency_optimized_scheduler=false".strip()
