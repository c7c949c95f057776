"""tfgpt2.testing.reference: OpenAI's original code in a child process, leaving this process TF2."""
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python import tf2

from tests.helpers import ATOL, require_reference
from tfgpt2.testing.reference_diff import greedy
from tfgpt2.testing.reference import Reference, ReferenceError

pytestmark = pytest.mark.slow  # the reference in a child process

TOKENS = np.array([[6109, 3626, 6100, 345], [6109, 1110, 6622, 257]], np.int32)


def test_leaves_no_trace(tiny, reference_tiny):
    model, ref = tiny, reference_tiny
    real_tf, path = sys.modules["tensorflow"], list(sys.path)
    theirs = ref.model(TOKENS)
    ref.sample_sequence(context=TOKENS[:1], length=2, top_k=1, seed=0)
    assert sys.modules["tensorflow"] is real_tf is tf
    assert tf.executing_eagerly() and tf2.enabled()
    assert "tensorflow.contrib" not in sys.modules and "sample" not in sys.modules
    assert sys.path == path
    ours = model(TOKENS)  # tfgpt2 still works in this process, eagerly and traced
    np.testing.assert_allclose(ours["logits"], theirs["logits"], atol=ATOL, rtol=0)
    traced = tf.function(lambda x: model(x)["logits"])
    # float32 rounding only: the traced graph's kernels may sum in another order (on AVX2
    # machines, 1.07e-5 apart at a logit of 2.79, and 1.06e-5 at one of 0.05)
    np.testing.assert_allclose(traced(tf.constant(TOKENS)), ours["logits"], atol=2e-5, rtol=1e-5)


def test_hidden_is_each_blocks_output_with_and_without_past(tiny, reference_tiny):
    model, ref = tiny, reference_tiny
    theirs = ref.model(TOKENS, hidden=True)
    n_layer, n_embd = model.hparams.n_layer, model.hparams.n_embd
    assert theirs["hidden"].shape == (2, n_layer, 4, n_embd)
    np.testing.assert_allclose(model(TOKENS, return_hidden=True)["hidden"], theirs["hidden"], atol=ATOL, rtol=0)
    assert "hidden" not in ref.model(TOKENS)
    later = ref.model(TOKENS[:, 3:], past=ref.model(TOKENS[:, :3])["present"], hidden=True)
    np.testing.assert_allclose(later["hidden"], theirs["hidden"][:, :, 3:], atol=ATOL, rtol=0)


def test_sample_sequence_with_top_k_1_is_greedy(tiny, reference_tiny):
    model, ref = tiny, reference_tiny
    tokens, seconds = ref.sample_sequence(context=TOKENS[1:], length=6, top_k=1, seed=0, repeats=2)
    assert tokens.shape == (1, 10) and len(seconds) == 2
    np.testing.assert_array_equal(tokens, greedy(model, TOKENS[1:], 6))


def test_failed_call_raises_and_the_process_serves_on(tiny, reference_tiny):
    model, ref = tiny, reference_tiny
    with pytest.raises(ReferenceError, match="reference model failed"):
        ref.model(np.array([[model.hparams.n_vocab]]))
    assert ref.model(TOKENS)["logits"].shape == (2, 4, model.hparams.n_vocab)


def test_paths_checked_before_starting(tiny_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.py"):
        Reference(str(tmp_path), tiny_dir)
    with pytest.raises(FileNotFoundError, match="no hparams.json"):
        Reference(str(require_reference()), str(tmp_path))
