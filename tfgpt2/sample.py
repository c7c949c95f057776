"""OpenAI's `src/sample.py`: `top_k_logits`, `top_p_logits` (the sampler's, `decoding.sampler`)
and `sample_sequence`, and `generate`, the library's door to the engine: each reads its keywords
into one checked request (`decoding.request`) and runs it over the whole batch at once
(`decoding.batch.complete`: one XLA-compiled generation loop, `tfgpt2.decoding`).
"""
import numbers

import numpy as np

from .decoding.batch import complete
from .decoding.request import check_request, check_value
from .decoding.sampler import top_k_logits, top_p_logits  # noqa: F401  the original's, beside sample_sequence
from .encoder import EOT_TOKEN

# ---- the library's entry points ---------------------------------------------------------

def generate(model, prompts, length, *, temperature=1.0, top_k=0, top_p=1.0, seed=None,
             stop_at_eot=False, eot=EOT_TOKEN, jit_compile=True, progress=None, chunk=32,
             logit_bias=None, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
             min_p=0.0, stop=None, stream=False, context_keep=None, stop_token_ids=None, min_tokens=0,
             include_stop_str_in_output=False, logprobs=None, prompt_logprobs=None, encoder=None):
    """Continue each prompt (a list of token lists, lengths may differ) by up to `length`
    tokens. Returns a list of 1-D arrays, each prompt + its new tokens (cut after `eot`
    where `stop_at_eot`). Each row is generated as if alone (left padding, an attention mask,
    positions counted per row). With `progress`, a callable, the loop runs `chunk` tokens at
    a time and `progress(n)` is told the number of new tokens so far after each piece.

    The controls, applied at each step in this order (docs/generation.md): `logit_bias` {token
    id: value added to its logit; -inf or <= -100 bans it}, `repetition_penalty` (CTRL's, over
    the prompt and the new tokens; 1 is off), `presence_penalty` and `frequency_penalty`
    (OpenAI's, over the new tokens), then temperature, top-k, top-p and `min_p`. `stop`: stop
    strings (a text or texts: the row's text ends before the first one it contains, wherever
    token boundaries fall) and token lists (a row ends as soon as its new tokens end with one,
    which is left out; also `stop_token_ids`, vLLM's: token ids or token lists);
    `include_stop_str_in_output` keeps the stop; `min_tokens`: end-of-text and stops wait for
    that many new tokens. `logprobs=k`: each new token's log-probability and the k most likely
    (of the model's distribution, as the server reports them); `prompt_logprobs=k`: the
    prompt's.

    Where a request has stop strings or log-probabilities (or `encoder`, the model's
    `tfgpt2.encoder.Encoder`, is given: by default GPT-2's), each row is a
    `decoding.text.Completion` instead: its tokens, text (without the stop, or the
    <|endoftext|> that ended it), finish reason and log-probabilities.

    `stream=True` returns an iterator instead, yielding every `chunk` steps a list of each
    row's new tokens (text, for Completions) since the last yield; joined, they are the new
    tokens (text) of the call without it (a row's last tokens are held back while they could
    still begin a stop).

    A `length` past the context window (prompt + length - 1 > n_ctx) slides: once the window is
    full, the rows go on from their last `context_keep` tokens (default n_ctx // 2), encoded
    afresh (`decoding.batch`, docs/generation.md).

    Row r draws as its prompt alone seeded `seed` + r (`seeds.seed_of`), not depending on XLA
    (`jit_compile`) or on what else shares the batch.
    This is the `model.generate` of the issue tracker and of other libraries.
    """
    hp = model.hparams
    texts, sequences = _stops(stop)
    request = check_request(
        n_vocab=hp.n_vocab, n_ctx=hp.n_ctx, length=length, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, stop_at_eot=stop_at_eot, eot=eot, logit_bias=logit_bias, repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, min_p=min_p, stop=texts,
        names={} if stop_token_ids else {"stop_token_ids": "stop"},
        stop_token_ids=sequences + list(stop_token_ids or []), min_tokens=min_tokens,
        include_stop_str_in_output=include_stop_str_in_output, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        context_keep=(hp.n_ctx // 2 or None) if context_keep is None else context_keep)
    text = bool(request.stop) or logprobs is not None or prompt_logprobs is not None or encoder is not None
    return complete(model, prompts, request, encoder=encoder, text=text, jit_compile=jit_compile,
                    progress=progress, chunk=chunk, stream=stream)


def _stops(stop):
    """`generate`'s `stop` as (stop strings, token-id sequences)."""
    if stop is None or isinstance(stop, str):
        return stop, []
    if not isinstance(stop, (list, tuple)) or any(isinstance(s, numbers.Number) for s in stop):
        raise ValueError(f"stop must be a text, or a list of texts and token lists (token ids alone go in "
                         f"stop_token_ids), got {stop!r}")
    return [s for s in stop if isinstance(s, str)], [s for s in stop if not isinstance(s, str)]


def sample_sequence(*, model, length, start_token=None, batch_size=None, context=None,
                    temperature=1, top_k=0, top_p=1, seed=None, stop_at_eot=False, jit_compile=True,
                    progress=None, stream=False, context_keep=None, **controls):
    """The original's `sample_sequence`: returns context + `length` sampled tokens as an array
    [batch, context_len + length], for `context` [batch, context_len] or `start_token` and
    `batch_size`. Works for any batch size (the original fails above 1) and at temperature 0
    (greedy). A `context` whose rows differ in length gives a list of arrays instead; so does
    `stop_at_eot` or a `stop` control, whose rows may end early. `progress`, `stream`,
    `context_keep` (a `length` past n_ctx) and the controls (`logit_bias`, ..., `stop`): see `generate`.
    """
    if (start_token is None) == (context is None):
        raise ValueError("Specify exactly one of start_token and context!")
    if start_token is not None:
        batch_size = check_value("batch_size", batch_size) if batch_size is not None else None
        if batch_size is None:
            raise ValueError("start_token needs batch_size")
        context = [[start_token]] * batch_size
    rows = generate(model, list(context), length, temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=seed, stop_at_eot=stop_at_eot, jit_compile=jit_compile, progress=progress,
                    stream=stream, context_keep=context_keep, **controls)
    if stream or not isinstance(rows[0], np.ndarray):
        return rows
    same = len({len(r) for r in rows}) == 1 and not stop_at_eot and not controls.get("stop") \
        and not controls.get("stop_token_ids")
    return np.stack(rows) if same else rows
