"""The suite compiles its programs with cheaper XLA flags than XLA's defaults (conftest: the older
fusion code generator, LLVM's optimizations off), about half the CPU time of its compiles. Users
run XLA's defaults, so this checks that the flags change no result beyond rounding: the same
programs compiled with XLA's defaults, in a process of their own, give the same tokens, and
logits, log-probabilities and gradients within SCALE times the largest value of each.

Measured on the wide model (n_embd 1024, std 0.1 weights): the logits (up to 16.4) differ by up
to 4.8e-5, the log-probabilities (up to 3.7) by 1.4e-5, each gradient by at most 1.8e-5 times
its largest value: float32 rounding in the order of operations, a tenth of what the tests allow
between tfgpt2 and OpenAI's code. The older code generator alone changes nothing, bit for bit.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # a TensorFlow process of its own

SCALE = 5e-5
PROMPTS = [[464, 3797, 3332, 319], [6109, 3626, 6100, 345, 284]]


def results(model_dir):
    """What the programs compute on the model at `model_dir` (numpy arrays): greedy tokens and
    their log-probabilities, sampled tokens (top-k, top-p, penalties), the logits of a compiled
    forward pass and the gradients of the forks' loss (`lm_loss`)."""
    import tensorflow as tf

    from tfgpt2 import generate, load_model
    from tfgpt2.train.losses import lm_loss
    model = load_model(model_dir)
    greedy = generate(model, PROMPTS, 8, temperature=0.0, logprobs=2)
    sampled = generate(model, PROMPTS, 8, temperature=1.0, top_k=40, top_p=0.9, seed=3,
                       repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    tokens = np.random.default_rng(0).integers(0, model.hparams.n_vocab, [2, 24])

    @tf.function(jit_compile=True)
    def forward_and_gradients(tokens):
        with tf.GradientTape() as tape:
            logits = model(tokens)["logits"]
            loss = lm_loss(tokens[:, 1:], logits[:, :-1])  # the forks' loss, as fine-tuning compiles it
        return logits, tape.gradient(loss, model.trainable_weights)
    logits, gradients = forward_and_gradients(tf.constant(tokens))
    steps = [step for row in greedy for step in row.logprobs]  # (its log-probability, [(id, theirs)])
    out = dict(greedy=np.concatenate([row.tokens for row in greedy] + [[i for _, top in steps for i, _ in top]]),
               logprob=np.array([[value] + [v for _, v in top] for value, top in steps]),
               sampled=np.concatenate(sampled), logits=logits.numpy())
    out.update({f"gradient {i}": tf.convert_to_tensor(g).numpy() for i, g in enumerate(gradients)})
    return out


def write(model_dir, path):
    """`results` into the .npz file `path` (the child's side)."""
    np.savez(path, **results(model_dir))


def test_the_suites_xla_flags_change_results_by_rounding_only(wide_dir, tmp_path):
    cheaper = os.environ.get("TFGPT2_TEST_XLA_FLAGS", "").split()  # conftest's, in XLA_FLAGS
    if not cheaper:
        pytest.skip("XLA_FLAGS sets what the suite's flags would: the tests compile as it says")
    defaults = " ".join(flag for flag in os.environ["XLA_FLAGS"].split() if flag not in cheaper)
    path = tmp_path / "defaults.npz"
    run = subprocess.run([sys.executable, "-c", f"from tests.test_xla_flags import write; write({str(wide_dir)!r}, "
                          f"{str(path)!r})"], cwd=ROOT, env=dict(os.environ, XLA_FLAGS=defaults, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    expected, ours = np.load(path), results(wide_dir)
    assert set(expected) == set(ours)
    for name in ("greedy", "sampled"):
        np.testing.assert_array_equal(ours[name], expected[name], err_msg=name)
    for name in sorted(set(ours) - {"greedy", "sampled"}):
        largest, difference = np.abs(expected[name]).max(), np.abs(ours[name] - expected[name]).max()
        assert 0 < largest and difference <= SCALE * largest, f"{name}: {difference} against values up to {largest}"
