"""Sampling and the compiled generation loop: against the reference, against the uncached
model, and the statistics of top-k, top-p and temperature."""
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import require_reference
from tfgpt2 import load_model
from tfgpt2.model import conv1d_layers, past_shape, transposed_weights
from tfgpt2.reference import Reference
from tfgpt2.sample import choose, generate, generator_for, sample_sequence, top_k_logits, top_p_logits

ATOL = 5e-4


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


def prompts_for(seed, lengths, n_vocab=50257):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, size=n).tolist() for n in lengths]


def greedy_uncached(model, prompt, length):
    """Greedy continuation by full forward passes over the whole sequence, no cache."""
    tokens = list(prompt)
    for _ in range(length):
        tokens.append(int(np.argmax(model(np.array([tokens]))["logits"][0, -1])))
    return tokens


# ---- against the reference --------------------------------------------------------------

def test_greedy_matches_reference_124m(gpt2_124m_dir):
    """Batch 2, 64 new tokens; the reference's sample_sequence only runs at batch 1 (its
    top_p_logits fails above), so each of our rows is compared with the reference on that row."""
    src = require_reference()
    model = load_model(gpt2_124m_dir)
    context = np.array(prompts_for(0, [5, 5]))
    ours = sample_sequence(model=model, context=context, length=64, top_k=1, seed=0)
    assert ours.shape == (2, 5 + 64)
    with Reference(str(src), gpt2_124m_dir) as ref:
        for row in range(2):
            theirs, _ = ref.sample_sequence(context=context[row:row + 1], length=64, top_k=1, seed=0)
            np.testing.assert_array_equal(ours[row], theirs[0], err_msg=f"row {row}")
            if row == 0:  # 8 < TRANSPOSE_FROM new tokens: the untransposed weights
                alone = sample_sequence(model=model, context=context[:1], length=8, top_k=1, seed=0)
                np.testing.assert_array_equal(alone[0], theirs[0, :5 + 8], err_msg="row 0, 8 tokens")
    assert len(set(ours[0, 5:].tolist())) > 5, "degenerate continuation; weights too small?"


# ---- the cache path against the uncached model ----------------------------------------

@pytest.mark.parametrize("pad", [0, 3])
def test_cached_steps_equal_full_forward(tiny, pad):
    """Prefill then one token at a time through the fixed-size cache, at every position,
    against one uncached pass over the whole sequence; with and without left padding."""
    hp = tiny.hparams
    tokens = np.array(prompts_for(1, [12, 12]))
    full = tiny(tokens)["logits"].numpy()
    shape = past_shape(hparams=hp, batch_size=2, sequence=32)
    cache = [(tf.zeros(shape[:1] + shape[3:]),) * 2 for _ in range(hp.n_layer)]
    pads = tf.constant([pad, pad])
    padded = np.concatenate([np.zeros([2, pad], np.int64), tokens[:, :5]], axis=1)
    out = tiny(padded, cache, pad=pads, cache_index=0)
    np.testing.assert_allclose(out["logits"].numpy()[:, pad:], full[:, :5], atol=ATOL, rtol=0)
    for t in range(5, 12):
        out = tiny(tokens[:, t:t + 1], out["present"], pad=pads, cache_index=pad + t)
        np.testing.assert_allclose(out["logits"].numpy()[:, 0], full[:, t], atol=ATOL, rtol=0,
                                   err_msg=f"position {t}")


@pytest.mark.parametrize("jit_compile", [True, False])
def test_compiled_greedy_equals_uncached_greedy(tiny, jit_compile):
    prompt = prompts_for(2, [4])[0]
    ours = generate(tiny, [prompt], 20, top_k=1, jit_compile=jit_compile)[0]
    assert ours.tolist() == greedy_uncached(tiny, prompt, 20)


def test_transposed_weights_give_the_same_logits(wide_dir):
    """The [nf, nx] copies batch-1 generation multiplies by on a CPU: prefill and one cached
    step under XLA, against the model's own weights."""
    model = load_model(wide_dir)
    hp = model.hparams
    weights = generator_for(model).transposed()
    assert [tuple(w.shape) for w in weights[:4]] == [
        (3 * hp.n_embd, hp.n_embd), (hp.n_embd, hp.n_embd), (4 * hp.n_embd, hp.n_embd), (hp.n_embd, 4 * hp.n_embd)]

    @tf.function(jit_compile=True)
    def two_steps(tokens, weights):
        with transposed_weights(dict(zip(conv1d_layers(model), weights))):
            shape = past_shape(hparams=hp, batch_size=1, sequence=16)
            cache = [(tf.zeros(shape[:1] + shape[3:]),) * 2 for _ in range(hp.n_layer)]
            out = model(tokens[:, :5], cache, cache_index=0)
            return out["logits"], model(tokens[:, 5:6], out["present"], cache_index=5)["logits"]

    tokens = np.array(prompts_for(11, [6]))
    full = model(tokens)["logits"].numpy()
    for weights_used in (weights, ()):
        prefill, step = two_steps(tf.constant(tokens), weights_used)
        np.testing.assert_allclose(prefill.numpy()[0], full[0, :5], atol=ATOL, rtol=0)
        np.testing.assert_allclose(step.numpy()[0, 0], full[0, 5], atol=ATOL, rtol=0)


def test_generation_uses_transposed_weights_where_they_pay(wide_dir):
    model = load_model(wide_dir)
    gen = generator_for(model)
    assert len(gen.weights_for(16)) == 4 * model.hparams.n_layer
    assert gen.weights_for(15) == ()
    assert generator_for(model, jit_compile=False).weights_for(16) == ()
    prompts = prompts_for(12, [3, 1, 6])
    copies, transposed = [], gen.transposed
    gen.transposed = lambda: copies.append(1) or transposed()
    try:
        together = generate(model, prompts, 40, top_k=1)
    finally:
        gen.transposed = transposed
    assert copies == [1], "generate did not use the transposed copies"
    for prompt, row in zip(prompts, together):
        assert row.tolist() == greedy_uncached(model, prompt, 40)


def test_temperature_zero_is_greedy(tiny):
    prompt = prompts_for(3, [3])
    a = generate(tiny, prompt, 12, temperature=0)[0]
    b = generate(tiny, prompt, 12, top_k=1, seed=5)[0]
    np.testing.assert_array_equal(a, b)


# ---- batches of different lengths and compiles -----------------------------------------

@pytest.mark.parametrize("folder", ["tiny_dir", "wide_dir"])
def test_variable_length_batch_rows_equal_rows_alone(folder, request):
    model = load_model(request.getfixturevalue(folder))
    prompts = prompts_for(4, [1, 7, 3, 12])
    together = generate(model, prompts, 10, top_k=1)
    for prompt, row in zip(prompts, together):
        alone = generate(model, [prompt], 10, top_k=1)[0]
        np.testing.assert_array_equal(row, alone)
        assert row[:len(prompt)].tolist() == prompt


def test_one_compile_per_bucket(tiny):
    gen = generator_for(tiny)
    before = gen.traces
    for length, new in [(3, 5), (5, 6), (9, 2), (16, 8)]:  # prompt bucket 16, total bucket 24
        generate(tiny, prompts_for(length, [length, length]), new, seed=1)
    assert gen.traces - before == 1
    generate(tiny, prompts_for(7, [17, 17]), 5, seed=1)  # prompt bucket 24: one more
    assert gen.traces - before == 2


def test_stop_at_eot_per_row(tiny):
    prompts = prompts_for(5, [3, 6])
    free = generate(tiny, prompts, 15, top_k=1)
    stop = int(free[0][3 + 4])  # the 5th token row 0 generates stands in for <|endoftext|>
    rows = generate(tiny, prompts, 15, top_k=1, stop_at_eot=True, eot=stop)
    for free_row, row, prompt in zip(free, rows, prompts):
        new = free_row[len(prompt):].tolist()
        cut = new.index(stop) + 1 if stop in new else len(new)
        assert row[len(prompt):].tolist() == new[:cut]
    assert len(rows[0]) == 3 + 5


@pytest.mark.parametrize("stop_at_eot", [False, True])
def test_generation_in_pieces_with_progress(tiny, stop_at_eot):
    """`progress` runs the loop a chunk at a time: same tokens, counts that grow to the end."""
    prompts = prompts_for(8, [2, 5])
    whole = generate(tiny, prompts, 23, seed=3)
    eot = int(whole[0][2 + 9]) if stop_at_eot else 50256
    whole = generate(tiny, prompts, 23, seed=3, stop_at_eot=stop_at_eot, eot=eot)
    seen = []
    pieces = generate(tiny, prompts, 23, seed=3, stop_at_eot=stop_at_eot, eot=eot, progress=seen.append, chunk=5)
    for a, b in zip(whole, pieces):
        np.testing.assert_array_equal(a, b)
    assert seen == sorted(seen) and seen[0] == 1 and len(seen) >= 3
    assert seen[-1] == max(len(row) - len(p) for row, p in zip(whole, prompts))


# ---- sampling statistics ----------------------------------------------------------------

def reference_top_k(logits, k):
    kth = np.sort(logits, axis=-1)[:, ::-1][:, k - 1:k]
    return np.where(logits < kth, -1e10, logits)


def reference_top_p(logits, p):
    """The original rule, row by row (the original itself only runs at batch 1)."""
    out = []
    for row in logits:
        s = np.sort(row)[::-1]
        probs = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        n = max(int((np.cumsum(probs) <= p).sum()) - 1, 0)
        out.append(np.where(row < s[n], -1e10, row))
    return np.array(out)


@pytest.mark.parametrize("k", [1, 2, 7, 40, 50])
def test_top_k_logits_matches_sorting(k):
    logits = np.random.default_rng(k).normal(size=[3, 50]).astype(np.float32) * 3
    logits[1, :5] = logits[1, 5]  # ties
    np.testing.assert_array_equal(top_k_logits(tf.constant(logits), tf.constant(k)).numpy(),
                                  reference_top_k(logits, k))
    np.testing.assert_array_equal(top_k_logits(tf.constant(logits), 0).numpy(), logits)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 0.999])
def test_top_p_logits_matches_original_rule_for_any_batch(p):
    logits = np.random.default_rng(int(p * 1000)).normal(size=[4, 200]).astype(np.float32) * 2
    np.testing.assert_array_equal(top_p_logits(tf.constant(logits), tf.constant(p)).numpy(),
                                  reference_top_p(logits, p))
    np.testing.assert_array_equal(top_p_logits(tf.constant(logits), 1.0).numpy(), logits)


def draws(logits, n, **kwargs):
    """n independent draws from one row of logits (n rows in one call)."""
    batch = tf.constant(np.repeat(logits[None], n, axis=0))
    args = dict(temperature=tf.constant(1.0), top_k=tf.constant(0), top_p=tf.constant(1.0),
                seed=tf.constant([7, 0], tf.int64))
    args.update({k: tf.constant(v, dtype=args[k].dtype) for k, v in kwargs.items()})
    return tf.function(choose, jit_compile=True)(batch, **args).numpy()


def test_samples_lie_in_top_k_and_nucleus():
    logits = np.random.default_rng(0).normal(size=300).astype(np.float32) * 2
    in_top_k = set(np.argsort(-logits)[:10].tolist())
    assert set(draws(logits, 5000, top_k=10).tolist()) <= in_top_k
    nucleus = set(np.flatnonzero(reference_top_p(logits[None], 0.6)[0] > -1e9).tolist())
    seen = set(draws(logits, 5000, top_p=0.6).tolist())
    assert seen <= nucleus and len(seen) > 1
    both = set(np.flatnonzero(reference_top_p(reference_top_k(logits[None], 20), 0.5)[0] > -1e9).tolist())
    assert set(draws(logits, 5000, top_k=20, top_p=0.5).tolist()) <= both


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_distribution_matches_softmax(temperature):
    """Chi-square test of 40,000 draws over 12 tokens against softmax(logits / T)."""
    logits = np.random.default_rng(1).normal(size=12).astype(np.float32)
    n = 40_000
    counts = np.bincount(draws(logits, n, temperature=temperature), minlength=12)
    expected = np.exp(logits / temperature) / np.exp(logits / temperature).sum() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 31.26, f"chi-square {chi2:.1f} >= 31.26 (df 11, p = 0.001)"


def test_seed_reproducible_and_seeds_differ(tiny):
    prompts = prompts_for(6, [4, 4])
    a = generate(tiny, prompts, 16, seed=123)
    b = generate(tiny, prompts, 16, seed=123)
    c = generate(tiny, prompts, 16, seed=124)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


# ---- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, length, kwargs, message", [
    ([[1, 50257]], 4, {}, r"prompt 0: token id 50257 out of range \[0, n_vocab=50257\)"),
    ([[1], [-3]], 4, {}, r"prompt 1: token id -3 out of range"),
    ([[1] * 60], 6, {}, r"prompt 0: 60 tokens \+ length 6 - 1 exceeds the context window n_ctx=64"),
    ([[1]], 0, {}, r"length must be >= 1"),
    ([[]], 3, {}, r"at least one token"),
    ([[1]], 3, {"top_k": -1}, r"top_k must be >= 0"),
    ([[1]], 3, {"top_p": 1.5}, r"top_p must be in \[0, 1\]"),
    ([[1]], 3, {"temperature": -1}, r"temperature must be >= 0"),
])
def test_bad_input(tiny, prompts, length, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny, prompts, length, **kwargs)


def test_sample_sequence_api(tiny):
    out = sample_sequence(model=tiny, length=6, start_token=50256, batch_size=3, top_k=1)
    assert out.shape == (3, 7) and (out[:, 0] == 50256).all()
    assert (out == out[0]).all()
    ragged = sample_sequence(model=tiny, length=4, context=[[1, 2], [3]], top_k=1)
    assert [len(r) for r in ragged] == [6, 5]
    with pytest.raises(ValueError, match="exactly one of start_token and context"):
        sample_sequence(model=tiny, length=4)
