"""The compiled training step: the forks' loss over a batch of windows, gradients averaged
over micro-batches (`--accumulate_gradients`) and replicas (`tf.distribute`), then the update."""
import os

import tensorflow as tf

from ..model import window_loss
from . import distribute


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
        # Autograph (which rewrites the Python of everything traced, the model's too) only for
        # the micro-batch loop: the rest is plain TensorFlow, traced in about half the time.
        fuse_update = jit_compile and self.strategy.num_replicas_in_sync == 1
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


def prefer_memory_schedule():
    """Ask XLA's CPU scheduler for its memory-minimizing order. By default it orders for
    concurrency and keeps alive the activations that `--remat` frees. A process-wide flag
    (`XLA_FLAGS`), read at the first XLA compilation: set before any, or it does nothing."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_enable_concurrency_optimized_scheduler=false".strip()
