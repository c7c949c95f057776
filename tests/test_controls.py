"""The generation controls (tfgpt2/decoding/controls.py): logit bias, repetition, presence and
frequency penalties, min-p, stop sequences and streaming, against a plain NumPy loop over the
model's logits (`tests.helpers.reference_logits`), against Hugging Face's processors where
installed, and their checks."""
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import chi_square, filtered_softmax, prompts_for, reference_logits
from tfgpt2.decoding import controls as control
from tfgpt2.decoding import step
from tfgpt2.decoding.generator import generator_for
from tfgpt2.decoding.sampler import choose, min_p_logits
from tfgpt2.sample import generate, sample_sequence


def reference_greedy(last_logits, prompt, length, stop=(), **controls):
    """Greedy decoding of one row alone; a row whose new tokens end with a stop sequence ends,
    without it (the longest, where several match)."""
    new = []
    for _ in range(length):
        new.append(int(np.argmax(reference_logits(last_logits(list(prompt) + new), prompt, new, **controls))))
        ends = [len(s) for s in stop if new[-len(s):] == list(s)]
        if ends:
            return list(prompt) + new[:-max(ends)]
    return list(prompt) + new


PROMPTS = prompts_for(11, [3, 7, 5])
LENGTH = 12


@pytest.fixture(scope="module")
def free(tiny):
    """Greedy rows without controls."""
    return [row.tolist() for row in generate(tiny, PROMPTS, LENGTH, temperature=0)]


def request(name, free):
    """Controls that change greedy rows of the tiny model (checked by the test)."""
    new = [row[len(p):] for row, p in zip(free, PROMPTS)]
    stop = [new[1][4:6], [new[2][3]], [7, 7, 7]]  # row 1 at its 6th new token, row 2 at its 4th
    return dict(
        bias=dict(logit_bias={new[0][2]: -100, new[1][0]: float("-inf"), 318: 6.0, 1000: -3.5}),
        repetition=dict(repetition_penalty=3.0),
        presence=dict(presence_penalty=4.0),
        frequency=dict(frequency_penalty=2.5),
        min_p=dict(min_p=0.3),
        stop=dict(stop=stop),
        all=dict(logit_bias={318: 4.0, new[0][1]: -100}, repetition_penalty=1.7, presence_penalty=1.5,
                 frequency_penalty=0.5, min_p=0.2, stop=stop),
    )[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bias", "repetition", "presence", "frequency", "min_p", "stop", "all"])
def test_greedy_rows_match_a_numpy_loop(tiny, last_logits, free, name):
    """Batch 3, prompts of 3, 7 and 5 tokens (left-padded): greedy tokens equal to the NumPy
    loop's over the uncached logits, for each control alone and all together (XLA for those,
    the same loop without XLA for each alone, which traces faster)."""
    controls = request(name, free)
    rows = generate(tiny, PROMPTS, LENGTH, temperature=0, jit_compile=name == "all", **controls)
    for row, (ours, prompt) in enumerate(zip(rows, PROMPTS)):
        assert ours.tolist() == reference_greedy(last_logits, prompt, LENGTH, **controls), f"row {row}"
    if name != "min_p":  # greedy takes the most likely token, which min-p always keeps
        assert [r.tolist() for r in rows] != free, "the control changed nothing: the test shows nothing"
    if name == "stop":
        assert [len(r) - len(p) for r, p in zip(rows, PROMPTS)] == [LENGTH, 4, 3]


def test_controls_match_transformers_processors():
    """Hugging Face's RepetitionPenaltyLogitsProcessor and MinPLogitsWarper on the same logits."""
    torch = pytest.importorskip("torch", reason="the optional transformers comparison needs torch")
    hf = pytest.importorskip("transformers", reason="the optional comparison needs transformers")
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(3, 500)) * 3).astype(np.float32)
    ids = rng.integers(0, 500, size=(3, 9))
    seen = np.zeros([3, 500], bool)
    np.put_along_axis(seen, ids, True, axis=1)
    state = dict(seen=tf.constant(seen), counts=tf.zeros([3, 500], tf.int32))
    ours = control.adjusted(tf.constant(logits), dict(repetition=tf.fill([3], 1.8)), state).numpy()
    theirs = hf.RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor(ids), torch.tensor(logits)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    for min_p in (0.05, 0.3, 0.9):
        ours = min_p_logits(tf.constant(logits), tf.fill([3], min_p)).numpy()
        theirs = hf.MinPLogitsWarper(min_p)(torch.tensor(ids), torch.tensor(logits)).numpy()
        np.testing.assert_array_equal(ours > -1e9, np.isfinite(theirs))
        np.testing.assert_array_equal(ours[ours > -1e9], theirs[np.isfinite(theirs)])


@pytest.mark.slow
def test_min_p_draws_meet_the_threshold_and_the_distribution():
    """20,000 seeded draws with min_p: every token's probability >= min_p x the largest, and
    the counts match the softmax renormalised over the kept tokens (chi-square, p = 0.001)."""
    logits = np.random.default_rng(5).normal(size=60).astype(np.float32) * 1.5
    probs = np.exp(logits.astype(np.float64) - logits.max())
    kept = probs >= 0.15 * probs.max()
    assert 3 <= kept.sum() < 60
    tokens = tf.function(choose, jit_compile=True, autograph=False)(
        tf.constant(np.repeat(logits[None], 20_000, axis=0)), temperature=tf.constant(1.0), top_k=tf.constant(0),
        top_p=tf.constant(1.0), seed=tf.constant([7, 0], tf.int64), min_p=tf.fill([20_000], 0.15)).numpy()
    assert kept[tokens].all()
    counts = np.bincount(tokens, minlength=60)
    df = int(kept.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty, p = 0.001
    assert chi_square(counts, filtered_softmax(logits.astype(np.float64), kept)) < critical


@pytest.mark.slow
def test_streamed_chunks_join_to_the_whole_without_compiling_again(tiny, free):
    """Sampled, with every control and a two-token stop sequence that straddles a chunk: the
    chunks joined are the rows of the same call without streaming; other chunk sizes and
    other values of the controls compile nothing more (stop sequences: in the same power-of-two
    shape)."""
    generator = generator_for(tiny)
    before = generator.traces
    options = dict(request("all", free), seed=4, top_k=50, chunk=5)
    unstopped = generate(tiny, PROMPTS, LENGTH, progress=lambda n: None, **dict(options, stop=[[7, 7, 7], [8], [9]]))
    new = [row[len(p):].tolist() for row, p in zip(unstopped, PROMPTS)]
    options["stop"] = [new[1][4:6], [new[2][3]], [7, 7, 7]]  # tokens 4 and 5 of row 1: chunks 1 and 2
    whole = generate(tiny, PROMPTS, LENGTH, progress=lambda n: None, **options)
    assert [len(r) - len(p) for r, p in zip(whole, PROMPTS)] == [LENGTH, 4, 3]
    for chunk in (5, 3, 1):
        pieces = list(generate(tiny, PROMPTS, LENGTH, stream=True, **dict(options, chunk=chunk)))
        assert len(pieces) >= LENGTH // chunk
        for row, (prompt, expected) in enumerate(zip(PROMPTS, whole)):
            joined = np.concatenate([piece[row] for piece in pieces])
            np.testing.assert_array_equal(joined, expected[len(prompt):], err_msg=f"chunk {chunk}, row {row}")
    traced = generator.traces
    other = dict(options, repetition_penalty=1.2, min_p=0.05, logit_bias={5: 1.0}, stop=[[5, 6], [7], [8, 9, 10]])
    list(sample_sequence(model=tiny, context=PROMPTS, length=LENGTH, stream=True, **other))
    assert generator.traces == traced, "another chunk size or other control values compiled again"
    assert traced - before <= 2  # start and resume, once


def test_defaults_leave_the_loop_as_it_was(tiny, monkeypatch):
    """Controls at their off values ask the loop for nothing more: the same options as before."""
    asked = []

    class Loop:
        def weights_for(self, length, batch, prompt_len):
            return None

        def run(self, weights, prompt, pad, tokens, length, controls, filters, top):
            asked.append((sorted(controls), filters, top))
            rows = prompt.shape[0]
            return dict(tokens=tf.concat([prompt, tokens[:, prompt.shape[1]:]], axis=1), count=tf.fill([rows], length),
                        finish=tf.fill([rows], 1), cut=tf.zeros([rows], tf.int32))
    monkeypatch.setattr("tfgpt2.decoding.batch.generator_for", lambda *args, **kwargs: Loop())
    generate(tiny, [[1, 2]], 3, seed=0, logit_bias={}, repetition_penalty=1, presence_penalty=0,
             frequency_penalty=0.0, min_p=0, stop=[], stop_token_ids=[], min_tokens=0,
             include_stop_str_in_output=False)
    generate(tiny, [[1, 2]], 3, seed=0, presence_penalty=0.5, stop=[[3]])
    generate(tiny, [[1, 2]], 3, seed=0, stop=["x"], min_tokens=1, logprobs=2)
    always = sorted(step.ALWAYS + ("eot",))
    assert asked[0] == (always, (False, False), None)
    assert asked[1][0] == sorted(always + ["frequency", "presence", "stop_ids"])
    assert asked[2][0] == sorted(always + ["ends", "min_tokens", "stop_lengths", "stops", "vocabulary"])
    assert asked[2][2] == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={50257: 1.0}), "logit_bias token must be a token id in [0, n_vocab=50257), got 50257"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token must be a token id in [0, n_vocab=50257), got -1"),
    (dict(logit_bias={5: float("nan")}), "logit_bias value must be a number < inf, got nan"),
    (dict(logit_bias={5: float("inf")}), "logit_bias value must be a number < inf, got inf"),
    (dict(logit_bias={5: "1"}), "logit_bias value must be a number < inf, got '1'"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a mapping"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0, got -1.0"),
    (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0, got 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number > 0, got nan"),
    (dict(presence_penalty=-0.5), "presence_penalty must be a finite number >= 0, got -0.5"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty must be a finite number >= 0, got inf"),
    (dict(min_p=1.5), "min_p must be a number in [0, 1], got 1.5"),
    (dict(min_p=float("nan")), "min_p must be a number in [0, 1], got nan"),
    (dict(stop=[[]]), "stop sequence 0 must be a token id or a non-empty list of token ids, got []"),
    (dict(stop=[[5], [50257]]), "stop sequence 1 token must be a token id in [0, n_vocab=50257), got 50257"),
    (dict(stop=[5, 6]), "stop must be a text, or a list of texts and token lists"),
    (dict(stop=[""]), "stop 0 must be 1 to 64 bytes of UTF-8, got 0: ''"),
    (dict(stop_token_ids=[50257]), "stop_token_ids sequence 0 token must be a token id in [0, n_vocab=50257)"),
    (dict(min_tokens=4), "min_tokens must be at most length (3), got 4"),
    (dict(logprobs=-1), "logprobs must be an integer in [0, 6), got -1"),
])
def test_bad_controls_are_refused_naming_them(tiny, kwargs, message):
    with pytest.raises(ValueError, match=f"^{__import__('re').escape(message)}"):
        generate(tiny, [[1, 2]], 3, **kwargs)


def test_a_bias_that_bans_every_token_is_refused(tiny):
    with pytest.raises(ValueError, match="logit_bias bans every token"):
        generate(tiny, [[1, 2]], 3, logit_bias={t: -100 for t in range(50257)})


def test_aligned_stops_end_at_the_last_column():
    stop = tf.constant([[[5, 6, -1], [7, -1, -1], [-1, -1, -1]]], tf.int32)
    aligned = control.aligned_stops(stop).numpy()
    assert aligned.shape == (1, 4, 4)
    assert aligned[0].tolist() == [[-1, -1, 5, 6], [-1, -1, -1, 7], [-1] * 4, [-1] * 4]
    tokens = tf.constant([[9, 9, 5, 6], [9, 7, 5, 6], [5, 6, 7, 0]])
    # row 0: the prompt is 2 tokens, so "5 6" counts; row 1: "7" ends nothing; row 2: 5 6 in the prompt
    assert control.stop_length(tokens, 2, 4, control.aligned_stops(tf.tile(stop, [3, 1, 1]))).numpy().tolist() \
        == [2, 2, 0]
