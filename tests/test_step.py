"""The per-token step's controls past the original's, through the library's door
(`tfgpt2.generate` on the tiny model), against a NumPy loop over the uncached logits
(`last_logits`): `min_tokens` (end-of-text and stops wait), vLLM's one-token `stop_token_ids`,
`include_stop_str_in_output`, and the log-probabilities of the new tokens and of the prompt
(the model's distribution before the controls, the values the server reports)."""
import numpy as np
import pytest

from tfgpt2.encoder import default_encoder

pytestmark = pytest.mark.slow  # compiles the tiny model's loop for each set of controls
ENC = default_encoder()
EOT = ENC.eot_token
PROMPT = ENC.encode("The cat sat on the mat")
LENGTH = 8


def log_softmax(logits):
    logits = logits.astype(np.float64)
    return logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())


def reference(last_logits, length, *, bias=None, banned_until=0, banned=()):
    """Greedy new tokens of PROMPT by a NumPy loop: `bias` {id: value} added, the `banned` ids
    kept out of the first `banned_until` tokens; with each token's log-softmax row (before them)."""
    new, rows = [], []
    for j in range(length):
        logits = last_logits(PROMPT + new).astype(np.float32)
        rows.append(log_softmax(logits))
        for token, value in (bias or {}).items():
            logits[token] += np.float32(value)
        if j < banned_until:
            logits[list(banned)] = -np.inf
        new.append(int(np.argmax(logits)))
        if new[-1] == EOT and j >= banned_until:
            break
    return new, rows


def test_min_tokens_holds_end_of_text_back(tiny, last_logits):
    """<|endoftext|> made the most likely token (a bias): with `stop_at_eot` and min_tokens 3 the
    row makes 3 other tokens, then ends at <|endoftext|>; a one-token stop is held back alike."""
    from tfgpt2 import generate
    bias = {EOT: 30.0}
    new, _ = reference(last_logits, LENGTH, bias=bias, banned_until=3, banned=[EOT])
    assert len(new) == 4 and new[-1] == EOT and EOT not in new[:3]
    row = generate(tiny, [PROMPT], LENGTH, temperature=0, logit_bias=bias, stop_at_eot=True, min_tokens=3)[0]
    assert row[len(PROMPT):].tolist() == new
    assert generate(tiny, [PROMPT], LENGTH, temperature=0, logit_bias=bias, stop_at_eot=True)[0][len(PROMPT):].tolist() \
        == [EOT]
    stopped = generate(tiny, [PROMPT], LENGTH, temperature=0, logit_bias=bias, stop_token_ids=[EOT], min_tokens=3,
                       encoder=ENC)[0]
    assert stopped.new_tokens.tolist() == new[:3] and stopped.finish_reason == "stop"  # the stop left out


def test_a_stop_kept_in_the_output_and_one_token_stop_ids(tiny, last_logits):
    """`include_stop_str_in_output` ends the text after the stop string; vLLM's stop_token_ids
    (single ids) end the row at that token, which is left out of the tokens and the text."""
    from tfgpt2 import generate
    new, _ = reference(last_logits, LENGTH)
    text = ENC.decode(new)
    stop = text[3:5]
    at = text.find(stop)
    kept = generate(tiny, [PROMPT], LENGTH, temperature=0, stop=[stop], include_stop_str_in_output=True,
                    encoder=ENC)[0]
    assert kept.text == text[:at + len(stop)] and kept.finish_reason == "stop"
    ended = generate(tiny, [PROMPT], LENGTH, temperature=0, stop_token_ids=[new[2]], encoder=ENC)[0]
    assert ended.new_tokens.tolist() == new[:new.index(new[2])] and ended.text == ENC.decode(new[:new.index(new[2])])


def test_log_probabilities_are_the_models(tiny, last_logits):
    """Each new token's log-probability and the 4 most likely, and the prompt's, equal NumPy's
    log-softmax of the uncached logits (before a bias, which changes the tokens, not them)."""
    from tfgpt2 import generate
    bias = {262: 3.0}
    new, rows = reference(last_logits, LENGTH, bias=bias)
    row = generate(tiny, [PROMPT], LENGTH, temperature=0, logit_bias=bias, logprobs=4, prompt_logprobs=2,
                   encoder=ENC)[0]
    assert row.new_tokens.tolist() == new
    for (logprob, top), token, want in zip(row.logprobs, new, rows):
        assert abs(logprob - want[token]) < 1e-4
        assert [t for t, _ in top] == np.argsort(-want)[:4].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(want)[::-1][:4], atol=1e-4)
    for j, (logprob, top) in enumerate(row.prompt_logprobs):
        want = log_softmax(last_logits(PROMPT[:j + 1]))
        assert abs(logprob - want[PROMPT[j + 1]]) < 1e-4 and [t for t, _ in top] == np.argsort(-want)[:2].tolist()
    assert len(row.prompt_logprobs) == len(PROMPT) - 1
