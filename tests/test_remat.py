"""GPT2(remat=True): each block recomputed in the backward pass; same gradients, less memory
(by XLA's own count of a train step's buffers; a process's peak varies with the machine and
its allocator, so it is a benchmark's figure, not a test)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import ROOT
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
    assert float(loss) == float(loss_remat)
    assert len(actual) == len(expected) == len(plain.trainable_variables)
    for v, a, e in zip(plain.trainable_variables, actual, expected):
        assert np.abs(tf.convert_to_tensor(a) - tf.convert_to_tensor(e)).max() <= 1e-5, v.path
    largest = max(float(tf.reduce_max(tf.abs(tf.convert_to_tensor(e)))) for e in expected)
    assert largest > 1e-3, "gradients too small to compare"


def test_remat_reruns_each_block_in_the_backward_pass(monkeypatch):
    """With remat each block runs twice per gradient, once forward and once again in the
    backward pass (which is what lowers the memory: only its input is kept in between); without,
    once. The memory itself is a figure of the machine and of XLA's version, measured by
    test_remat_lowers_xlas_own_count_of_a_train_steps_memory below."""
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


XLA_BYTES = """
import glob, os, re, sys, numpy as np, tensorflow as tf
from tfgpt2 import GPT2
from tfgpt2.hparams import default_hparams
from tfgpt2.train.optimizers import make_optimizer
from tfgpt2.train.step import Trainer
hparams = default_hparams().override_from_dict(dict(n_vocab=512, n_ctx=512, n_embd=64, n_head=4, n_layer=6))
tokens = tf.constant(np.random.default_rng(0).integers(0, 512, size=[1, 512]), tf.int32)
for remat in (False, True):
    float(Trainer(GPT2(hparams, remat=remat), make_optimizer("adam", 1e-3)).step(tokens))
    reports = glob.glob(os.path.join(sys.argv[1], "*memory-usage-report.txt"))
    print(max(int(re.search(r"Total bytes used: (\\d+)", open(f).read()).group(1)) for f in reports))
    for f in glob.glob(os.path.join(sys.argv[1], "*")):
        os.remove(f)
"""


@pytest.mark.slow
def test_remat_lowers_xlas_own_count_of_a_train_steps_memory(tmp_path):
    """The bytes XLA allocates for a compiled Adam step (6 blocks of width 64, 1 x 511 tokens,
    the memory-minimizing scheduler), by its own buffer assignment: exact, unlike a process's
    peak. Measured: 55 MiB without remat, 24 MiB with it (99 and 29 before the softmax's
    gradient was written out; 101 and 44 while the step kept an empty accumulation loop); 85 MiB
    of 99 when the rerun waited on the gradient only through an optimization barrier, which XLA
    drops before it schedules (so all blocks were rerun at once: 1.5 GB more for 124M at 1 x
    1023 tokens)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", TF_XLA_FLAGS="",  # compile here
               XLA_FLAGS=f"--xla_cpu_enable_concurrency_optimized_scheduler=false --xla_dump_to={tmp_path} "
                         "--xla_dump_hlo_pass_re=NONE")
    out = subprocess.run([sys.executable, "-c", XLA_BYTES, str(tmp_path)], capture_output=True, text=True, env=env,
                         check=True, cwd=str(ROOT))
    without, with_remat = (int(n) for n in re.findall(r"^(\d+)$", out.stdout, re.M)[-2:])
    print(f"XLA's bytes for a train step: {without / 2**20:.0f} MiB, with remat {with_remat / 2**20:.0f} MiB")
    assert with_remat < 0.55 * without


def test_train_cli_asks_xla_for_the_memory_schedule(monkeypatch):
    from tfgpt2.train.step import prefer_memory_schedule
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    prefer_memory_schedule()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_cpu_enable_fast_math=false",
                                               "--xla_cpu_enable_concurrency_optimized_scheduler=false"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    prefer_memory_schedule()  # the user's own choice stays
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"
