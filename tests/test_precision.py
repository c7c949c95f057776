"""Keras dtype policies (bfloat16, float16, mixed): dtypes of variables and activations,
logits against float32, greedy tokens, no NaN or inf (loading memory: in test_checkpoint.py; every
door against the eager logits at 16 bits and int8: test_low_precision_doors.py)."""

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import TINY, in_child, model_folder
from tfgpt2 import generate, load_model, save_model
from tfgpt2.decoding.cache import call_with_cache, empty_cache
from tfgpt2.model import attention_mask, mask_attn_weights

pytestmark = pytest.mark.own_process  # its programs compiled in a process of its own (tests/own_process.py)

POLICIES = ["bfloat16", "float16", "mixed_bfloat16", "mixed_float16"]
COMPUTE = {"bfloat16": "bfloat16", "float16": "float16", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
VARIABLE = {"bfloat16": "bfloat16", "float16": "float16", "mixed_bfloat16": "float32", "mixed_float16": "float32"}


@pytest.fixture(scope="module")
def tiny128_dir(tmp_path_factory):
    """TINY (std 0.3) with n_ctx 128, so that varied prompts take 64 new tokens."""
    return model_folder(tmp_path_factory, "tiny128", dict(TINY, n_ctx=128), 0.3)


@pytest.mark.parametrize("policy", POLICIES)
def test_variables_and_activations_follow_the_policy(tiny_dir, policy):
    model = load_model(tiny_dir, dtype=policy)
    assert {v.dtype for v in model.weights} == {VARIABLE[policy]}
    compute = tf.as_dtype(COMPUTE[policy])
    out = model([[1, 2, 3, 4]], return_hidden=True)
    assert out["logits"].dtype == tf.float32  # always, for the loss and sampling
    assert out["hidden"].dtype == compute and out["present"].dtype == compute
    x = tf.ones([1, 4, model.hparams.n_embd], compute)
    block = model.h[0]
    for layer, inputs in [(block.ln_1, x), (block.attn.c_attn, x), (block.mlp, x)]:
        assert layer(inputs).dtype == compute, layer.path
    # the fixed-size cache of generation stays in the compute dtype
    cache = empty_cache(model, 1, 16)
    logits, cache = call_with_cache(model, tf.constant([[1, 2]]), cache, 0)
    assert logits.dtype == tf.float32 and {c.dtype for pair in cache for c in pair} == {compute}


def test_float32_policy_is_the_default_model(tiny_dir):
    tokens = [[5, 6, 7, 8, 9]]
    np.testing.assert_array_equal(load_model(tiny_dir, dtype="float32")(tokens)["logits"],
                                  load_model(tiny_dir)(tokens)["logits"])


def test_mask_constant_is_finite_in_float16():
    """The original's -1e10 is -inf in float16, and w * 0 - inf * 0 gives NaN."""
    mask = attention_mask(3, 3, dtype=tf.float16)
    w = mask_attn_weights(tf.zeros([1, 1, 3, 3], tf.float16), mask)
    assert np.isfinite(w.numpy()).all()
    assert w.numpy()[0, 0, 0, 2] == -65504  # masked: float16's lowest, still far below any score
    w = mask_attn_weights(tf.zeros([1, 1, 3, 3]), attention_mask(3, 3, dtype=tf.float32))
    assert w.numpy()[0, 0, 0, 2] == -1e10  # float32: the original's constant


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_match_float32(tiny128_dir, policy):
    """Each new token of 16-bit greedy generation against float32's argmax after the same
    tokens, over 8 prompts x 64 steps. Measured: bfloat16 96.5%, float16 99.8%."""
    reference, model = load_model(tiny128_dir), load_model(tiny128_dir, dtype=policy)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50257, size=n).tolist() for n in (1, 3, 7, 12, 20, 33, 5, 9)]
    rows = generate(model, prompts, 64, temperature=0)
    agree = 0
    for prompt, row in zip(prompts, rows):
        assert len(row) == len(prompt) + 64
        logits = reference([row[:-1]])["logits"].numpy()[0, len(prompt) - 1:]
        agree += int((logits.argmax(-1) == row[len(prompt):]).sum())
    assert agree / (8 * 64) >= 0.9, f"{policy}: greedy tokens equal float32's for {agree} of 512 steps"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["float16", "mixed_float16"])
def test_float16_long_prompt_has_no_nan_or_inf(wide_dir, policy):
    """A prompt of n_ctx tokens through the 355M-shaped block (std 0.1), and generation."""
    model = load_model(wide_dir, dtype=policy)
    tokens = np.random.default_rng(1).integers(0, 50257, size=[2, model.hparams.n_ctx])
    out = model(tokens, return_hidden=True)
    for name in ("logits", "present", "hidden"):
        assert np.isfinite(tf.cast(out[name], tf.float32).numpy()).all(), name
    rows = generate(model, [tokens[0, :100].tolist(), [3]], 29, temperature=0)
    logits = model([rows[0][:-1]])["logits"].numpy()
    assert np.isfinite(logits).all() and len(rows[0]) == 129


def test_save_writes_float32(tiny_dir, tmp_path):
    model = load_model(tiny_dir, dtype="bfloat16")
    save_model(model, tmp_path / "saved")
    reader = tf.train.load_checkpoint(str(tmp_path / "saved" / "model.ckpt"))
    assert set(reader.get_variable_to_dtype_map().values()) == {tf.float32}
    again = load_model(tmp_path / "saved", dtype="bfloat16")
    for a, b in zip(model.weights, again.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


# Measured with this test's own checkpoint and tokens (124M-shaped, std 0.1, 2 prompts of 64
# random tokens) against tfgpt2 at float32 (itself within 5e-4 of OpenAI's code), logits of
# max |logit| about 15: max abs error bfloat16 1.80 (median 0.126), float16 0.217 (median
# 0.0163), mixed_* the same (the variables are rounded to the compute dtype where used). With
# another seed's weights: 1.58 and 0.21; at 256 tokens: 2.07 and 0.37. Tolerances: the
# measured maximum plus about a third; a float16 model computing in bfloat16 fails them.
TOLERANCE = {"bfloat16": (2.4, 0.19), "float16": (0.32, 0.025)}


@pytest.mark.slow
def test_124m_logits_within_tolerance_of_float32(gpt2_124m_dir):
    in_child(check_124m_logits, gpt2_124m_dir)  # five 124M models: a process of its own


def check_124m_logits(model_dir):
    tokens = np.random.default_rng(0).integers(0, 50257, size=[2, 64])
    expected = load_model(model_dir)(tokens)["logits"].numpy()
    long = np.random.default_rng(1).integers(0, 50257, size=[1, 1024])
    for policy in POLICIES:
        model = load_model(model_dir, dtype=policy)
        error = np.abs(model(tokens)["logits"].numpy() - expected)
        largest, median = TOLERANCE[COMPUTE[policy]]
        print(f"{policy}: max abs {error.max():.3f}, median {np.median(error):.4f}")
        assert error.max() <= largest and np.median(error) <= median, \
            f"{policy}: max abs error {error.max():.3f} (<= {largest}), median {np.median(error):.4f} (<= {median})"
        if COMPUTE[policy] == "float16":  # bfloat16 has float32's range: it overflows where float32 does
            assert np.isfinite(model(long)["logits"].numpy()).all(), f"{policy}: NaN or inf with 1024 tokens"
