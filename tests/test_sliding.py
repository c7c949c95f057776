"""Generation past the context window (`tfgpt2.decoding.batch._sliding`): the first window is today's
output, then every row goes on from its last `context_keep` tokens, encoded afresh; against
a plain NumPy loop over `model(X)`'s logits with the same sliding rule, written here."""
import json

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import prompts_for, reference_logits
from tfgpt2.decoding.generator import generator_for
from tfgpt2.decoding.sampler import _uniform
from tfgpt2.sample import generate, sample_sequence
from tfgpt2.seeds import seed_of

pytestmark = pytest.mark.own_process  # its programs compiled in a process of its own (tests/own_process.py)

PROMPTS = prompts_for(5, [3, 7, 5])
N_CTX = 64
FIRST = N_CTX + 1 - 7  # new tokens before the first slide: the longest prompt fills the window
LENGTH = 110  # three segments at the default context_keep of 32: 58, 33, then 19 new tokens


def drawn(logits, temperature, seed, step, row, batch):
    """Sampling by inverse CDF with new token number `step`'s uniform from the row's stream (the
    library's: row r of a call seeded s draws as the row alone seeded s + r, `seeds.seed_of`)."""
    if not temperature:
        return int(np.argmax(logits))
    weights = np.exp((logits - logits.max()) / np.float32(temperature))
    cdf = np.cumsum(weights)
    u = _uniform(1, tf.constant([[seed_of(seed, row), step]], tf.int64)).numpy()[0] * cdf[-1]
    return min(int(np.sum(cdf <= u)), len(logits) - 1)


def reference_sliding(last_logits, prompts, length, keep, temperature=0.0, seed=0, **controls):
    """Rows past n_ctx, the rule of docs/generation.md: all rows slide when the longest context
    fills the window; each then goes on from its last `keep` tokens alone."""
    new = [[] for _ in prompts]
    contexts = [list(p) for p in prompts]
    while len(new[0]) < length:
        for _ in range(min(N_CTX + 1 - max(map(len, contexts)), length - len(new[0]))):
            for row, prompt in enumerate(prompts):
                logits = reference_logits(last_logits(contexts[row]), prompt, new[row], **controls)
                new[row].append(drawn(logits, temperature, seed, len(new[row]), row, len(prompts)))
                contexts[row].append(new[row][-1])
        contexts = [(list(p) + n)[-keep:] for p, n in zip(prompts, new)]
    return [list(p) + n for p, n in zip(prompts, new)]


@pytest.mark.slow
@pytest.mark.parametrize("keep, controls", [
    (None, {}),
    (None, dict(temperature=0.1, seed=7)),  # low: the tokens cannot hang on float noise
    (20, dict(logit_bias={318: 3.0}, repetition_penalty=1.2, presence_penalty=2.0, frequency_penalty=1.0)),
])
def test_past_n_ctx_matches_a_numpy_sliding_loop(tiny, last_logits, keep, controls):
    """Batch 3, prompts of 3, 7 and 5 tokens, 110 new tokens on n_ctx 64 (three segments or
    more): tokens identical to the NumPy loop, greedy and sampled (new token k of each row
    draws from the (seed, k) stream, in every segment); the penalties count every new token
    so far, across segments (the prompt too for the repetition penalty). The penalties run
    without XLA, which traces faster."""
    controls = dict(dict(temperature=0.0), **controls)
    rows = generate(tiny, PROMPTS, LENGTH, context_keep=keep, jit_compile="seed" in controls or len(controls) == 1,
                    **controls)
    expected = reference_sliding(last_logits, PROMPTS, LENGTH, keep or N_CTX // 2, **controls)
    assert [r.tolist() for r in rows] == expected


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.1, seed=7)])
def test_the_first_window_is_todays_output_and_seeds_repeat(tiny, sampling):
    """Each row's tokens up to the first slide are those of the longest `length` that fits,
    greedy and seeded sampling alike; the same seed gives the same tokens past it, another
    seed others; streamed chunks join to the same rows."""
    fits = generate(tiny, PROMPTS, FIRST, **sampling)
    rows = generate(tiny, PROMPTS, LENGTH, **sampling)
    assert [len(r) for r in rows] == [len(p) + LENGTH for p in PROMPTS]
    assert max(len(r) for r in fits) == N_CTX + 1
    for row, (short, long) in enumerate(zip(fits, rows)):
        assert long[:len(short)].tolist() == short.tolist(), f"row {row}"
    assert [r.tolist() for r in generate(tiny, PROMPTS, LENGTH, **sampling)] == [r.tolist() for r in rows]
    chunks = list(generate(tiny, PROMPTS, LENGTH, chunk=25, stream=True, **sampling))
    assert len(chunks) > 3
    for row, (p, r) in enumerate(zip(PROMPTS, rows)):
        assert np.concatenate([c[row] for c in chunks]).tolist() == r[len(p):].tolist(), f"row {row}"
    if "seed" in sampling:
        other = generate(tiny, PROMPTS, LENGTH, **dict(sampling, seed=8))
        assert all(a[FIRST + 7:].tolist() != b[FIRST + 7:].tolist() for a, b in zip(rows, other))


@pytest.mark.slow
def test_a_stop_sequence_across_a_slide_ends_the_row_and_traces_are_bounded(tiny):
    """A stop sequence whose first token is the last of a segment and whose second is the first
    of the next ends its row there (left out); the row stays ended in later segments; the
    others go on, streamed or not. Longer lengths compile nothing more."""
    free = generate(tiny, PROMPTS, LENGTH, temperature=0)
    new = free[0][len(PROMPTS[0]):].tolist()
    stop = new[FIRST - 1:FIRST + 1]
    ends = next(j for j in range(2, len(new) + 1) if new[j - 2:j] == stop) - 2  # its first occurrence
    assert ends > FIRST - 20, "the stop sequence occurs early: the test would not cross a slide"
    rows = generate(tiny, PROMPTS, LENGTH, temperature=0, stop=[stop])
    assert rows[0].tolist() == free[0][:len(PROMPTS[0]) + ends].tolist()
    for row in (1, 2):
        r, f = rows[row].tolist(), free[row].tolist()
        hit = [j for j in range(len(PROMPTS[row]) + 2, len(f) + 1) if f[j - 2:j] == stop]
        assert r == (f[:hit[0] - 2] if hit else f), f"row {row}"
    chunks = list(generate(tiny, PROMPTS, LENGTH, temperature=0, stop=[stop], chunk=16, stream=True))
    for row, (p, r) in enumerate(zip(PROMPTS, rows)):
        assert np.concatenate([c[row] for c in chunks]).tolist() == r[len(p):].tolist(), f"row {row}"
    generator = generator_for(tiny)
    traces = generator.traces
    generate(tiny, PROMPTS, LENGTH + 40, temperature=0, stop=[stop])  # four segments, the last of 26
    sample_sequence(model=tiny, context=PROMPTS, length=LENGTH + 17, temperature=0)
    assert generator.traces == traces


@pytest.mark.parametrize("keep, message", [
    (0, r"context_keep must be an integer in \[1, 64\), got 0"),
    (64, r"context_keep must be an integer in \[1, 64\), got 64"),
    (2.5, r"context_keep must be an integer in \[1, 64\), got 2.5"),
])
def test_context_keep_is_checked(tiny, keep, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny, [[1, 2]], 100, context_keep=keep)


def test_a_prompt_longer_than_the_window_is_still_refused(tiny):
    with pytest.raises(ValueError, match=r"prompt of 65 tokens exceeds the context window n_ctx=64"):
        generate(tiny, [[1] * 65], 3)
    with pytest.raises(ValueError, match=r"length must be an integer in \[1, 2\*\*31\), got 2147483648"):
        generate(tiny, [[1, 2]], 2**31)


@pytest.mark.slow
def test_the_commands_slide_with_context_keep(tiny, tiny_dir, tmp_path, capsys, signals, monkeypatch):
    """`tfgpt2 generate` and `generate-batch` with --context_keep print and write the tokens of
    `tfgpt2.generate` past the window; a --context_keep not below n_ctx is refused."""
    from tfgpt2.cli import common, generate as generate_command, generate_batch
    enc = common.encoder_of(tiny_dir)
    text = "the cat sat on the mat"
    context = enc.encode(text)
    argv = ["--model_dir", tiny_dir, "--prompt", text, "--length", "80", "--temperature", "0", "--quiet"]
    with pytest.raises(SystemExit, match=r"--context_keep must be an integer in \[1, 64\), got 64"):
        generate_command.main(argv + ["--context_keep", "64"])
    with pytest.raises(SystemExit, match="Can't get samples longer than window size: 64"):
        generate_command.main(argv)
    expected = generate(tiny, [context], 80, temperature=0, context_keep=20)[0][len(context):].tolist()
    assert len(context) + 80 - 1 > N_CTX
    from tfgpt2.formats import checkpoint
    monkeypatch.setattr(checkpoint, "load_model", lambda folder, **options: tiny)  # the loaded model
    generate_command.main(argv + ["--context_keep", "20"])
    assert enc.decode(expected) in capsys.readouterr().out
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": text}) + "\n")
    argv = ["--model_dir", tiny_dir, "--input", str(src), "--output", str(out), "--length", "80",
            "--temperature", "0", "--batch_size", "1", "--quiet"]
    capsys.readouterr()
    assert generate_batch.main(argv, tiny) == f"error: 1 bad line(s) of {src}, each named above (--skip_bad skips " \
        "such lines)"
    assert capsys.readouterr().err == f"{src}:1 (line 0 counted from 0): prompt of 6 tokens + --length 80 - 1 " \
        "exceeds the context window n_ctx=64\n"
    assert generate_batch.main(argv + ["--context_keep", "20"], tiny) == 0
    assert [json.loads(line)["tokens"] for line in open(out)] == [expected]
    assert generate_batch.main(argv + ["--context_keep", "64"], tiny) == \
        "error: --context_keep must be an integer in [1, 64), got 64"
