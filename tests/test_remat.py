"""GPT2(remat=True): each block recomputed in the backward pass, with the same gradients. How
much memory that saves depends on the machine and XLA's version: `tools/benchmark_memory.py`
reports it (XLA's own count of a compiled train step's bytes, with and without remat)."""
import os

import numpy as np
import pytest
import tensorflow as tf

from tfgpt2 import GPT2
from tfgpt2.hparams import default_hparams

HPARAMS = dict(n_vocab=256, n_ctx=256, n_embd=128, n_head=4, n_layer=6)


def gradients(model, tokens):
    with tf.GradientTape() as tape:
        logits = model(tokens)["logits"]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tokens[:, 1:], logits[:, :-1]))
    return loss, tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_remat_gives_the_same_gradients(compiled):
    hp = default_hparams().override_from_dict(dict(HPARAMS, n_layer=3, n_ctx=32))
    plain, remat = GPT2(hp), GPT2(hp, remat=True)
    for a, b in zip(remat.weights, plain.weights):
        b.assign(b * (5 if len(b.shape) > 1 else 1))  # matrices of std 0.1
        a.assign(b)
    tokens = tf.constant(np.random.default_rng(0).integers(0, 256, size=[2, 32]))
    run = tf.function(gradients) if compiled else gradients
    loss, expected = run(plain, tokens)
    loss_remat, actual = run(remat, tokens)
    # the same forward pass; on a GPU XLA may fuse the two programs' sums in other orders
    assert abs(float(loss) - float(loss_remat)) <= 1e-6 * abs(float(loss))
    assert len(actual) == len(expected) == len(plain.trainable_variables)
    for v, a, e in zip(plain.trainable_variables, actual, expected):
        assert np.abs(tf.convert_to_tensor(a) - tf.convert_to_tensor(e)).max() <= 1e-5, v.path
    largest = max(float(tf.reduce_max(tf.abs(tf.convert_to_tensor(e)))) for e in expected)
    assert largest > 1e-3, "gradients too small to compare"


def test_remat_reruns_each_block_in_the_backward_pass(monkeypatch):
    """With remat each block runs twice per gradient, once forward and once again in the
    backward pass (which is what lowers the memory: only its input is kept in between); without,
    once. The memory itself is a figure of the machine and of XLA's version
    (tools/benchmark_memory.py)."""
    from tfgpt2.model import Block
    runs, call = [], Block.call

    def counted(self, *args, **kwargs):
        runs.append(self.name)
        return call(self, *args, **kwargs)
    monkeypatch.setattr(Block, "call", counted)
    hp = default_hparams().override_from_dict(dict(HPARAMS, n_layer=3, n_ctx=16, n_embd=32))
    tokens = tf.constant(np.random.default_rng(0).integers(0, 256, size=[2, 16]))
    for remat, times in ((False, 1), (True, 2)):
        model = GPT2(hp, remat=remat)
        runs.clear()
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tokens)["logits"])
        assert runs == ["h0", "h1", "h2"], runs
        grads = tape.gradient(loss, model.trainable_variables)
        assert sorted(runs) == sorted(["h0", "h1", "h2"] * times), (remat, runs)
        assert all(g is not None for g in grads)


def test_train_cli_asks_xla_for_the_memory_schedule(monkeypatch):
    from tfgpt2.train.step import prefer_memory_schedule
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    prefer_memory_schedule()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_cpu_enable_fast_math=false",
                                               "--xla_cpu_enable_concurrency_optimized_scheduler=false"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    prefer_memory_schedule()  # the user's own choice stays
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
