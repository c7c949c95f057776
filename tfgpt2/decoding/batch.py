"""The whole batch at once: a checked request (`request.Request`) over a batch of prompts, run
by the compiled loop (`generator`) in the window or, past it, in slides (`_sliding`), whole,
in pieces (`progress`) or streamed; each row's tokens, or its text and log-probabilities
(`text.Completion`). The library's `tfgpt2.generate`, the commands and bulk generation call
`complete`; the server runs its slots (`slots`), LiteRT its file (`formats.litert`), each with
the same per-token step (`step`).

The loop runs over a key/value cache of fixed size written in place, not the original's
growing `tf.concat`. Prompts are left-padded to a length bucket and the cache sized to a
total-length bucket, so XLA compiles once per (batch size, prompt bucket, total bucket), not
once per prompt.
"""
import dataclasses

import numpy as np
import tensorflow as tf

from ..encoder import default_encoder
from ..seeds import seed_of
from . import step as per_token
from .buckets import bucket_sizes
from .generator import generator_for
from .request import check_prompts, check_value, check_window, fits
from .stops import Vocabulary
from .text import TextStream, completion, token_row


def complete(model, prompts, request, *, encoder=None, text=True, jit_compile=True, progress=None, chunk=32,
             stream=False):
    """`tfgpt2.generate` of a checked `request.Request` (the doors that read their own
    spelling into one call this): `text.Completion`s, or, without `text`, arrays as
    `tfgpt2.generate` returns them (a request with stop strings needs `text`)."""
    hp = model.hparams
    prompts = check_prompts(prompts, hp.n_vocab)
    check_window(max(map(len, prompts)), request.length, hp.n_ctx, context_keep=request.context_keep)
    chunk = check_value("chunk", chunk)
    vocabulary = _vocabulary(encoder, hp.n_vocab) if text else None
    rows = [dataclasses.replace(request, seed=seed_of(request.seed, r)) for r in range(len(prompts))]
    controls, filters = per_token.controls_for(rows, hp.n_vocab, vocabulary)
    loop = _Loop(generator_for(model, jit_compile=jit_compile), controls, filters, request.logprobs)
    every = chunk if stream or progress else None
    if fits(max(map(len, prompts)), request.length, hp.n_ctx):
        pieces = _in_window(loop, prompts, request.length, hp.n_ctx, every, progress)
    else:
        pieces = _sliding(loop, prompts, request.length, hp.n_ctx, request.context_keep, every or request.length,
                          progress)
    if stream:
        return _texts(pieces, vocabulary, request) if text else _streamed(pieces, _held(controls))
    for found in pieces:
        pass
    if not text:
        return [np.concatenate([p.astype(np.int32), np.asarray(new, np.int32)])
                for p, new in zip(prompts, found.kept())]
    scored = _prompt_scores(model, prompts, request.prompt_logprobs)
    return [completion(p, found.new[r], found.finish[r], found.cut[r], vocabulary.token_bytes,
                       scores=found.scores[r] if request.logprobs is not None else None,
                       prompt_scores=None if scored is None else scored[r]) for r, p in enumerate(prompts)]


def _vocabulary(encoder, n_vocab):
    """The token bytes of `encoder`, by default GPT-2's (whose size the model must have)."""
    vocabulary = Vocabulary.of(encoder or default_encoder())
    if len(vocabulary.items) != n_vocab:
        raise ValueError(f"the encoder has {len(vocabulary.items)} tokens, the model n_vocab={n_vocab}: pass the "
                         "model's encoder (encoder=tfgpt2.get_encoder(...))")
    return vocabulary


class _Loop:
    """The compiled loop and what every call of it takes: the controls, `choose`'s filters and
    how many most likely tokens to report (`top`: None for none)."""

    def __init__(self, generator, controls, filters, top):
        self.generator, self.controls, self.filters, self.top = generator, controls, filters, top

    def run(self, args, length):
        return self.generator.run(*args, tf.constant(length), self.controls, self.filters, self.top)

    def start(self, args):
        return self.generator.begin(*args, self.controls, self.top)

    def resume(self, weights, state, pad, prompt_len, until):
        return self.generator.resume(weights, state, pad, tf.constant(prompt_len), tf.constant(until), self.controls,
                                     self.filters, self.top)


class _Found:
    """Each row's new tokens so far (through the one that ended it), how it ended (`step`) and,
    where asked, each new token's (log-probability, top ids, theirs)."""

    def __init__(self, batch):
        self.new, self.scores = [[] for _ in range(batch)], [[] for _ in range(batch)]
        self.finish, self.cut = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
        self.before = [0] * batch  # each row's new tokens before the segment

    def segment(self):
        self.before = [len(n) for n in self.new]

    def take(self, state, prompt_len, start):
        """The tokens of the loop's `state` since the segment began (after `start` new tokens)."""
        tokens, count = state["tokens"].numpy(), state["count"].numpy()
        self.finish, self.cut = state["finish"].numpy(), state["cut"].numpy()
        scores = [state[k].numpy() for k in ("logprob", "top_ids", "top_logprobs")] if "logprob" in state else None
        for row, before in enumerate(self.before):
            columns = slice(prompt_len, prompt_len + max(int(count[row]) - start, 0))
            self.new[row] = self.new[row][:before] + tokens[row, columns].tolist()
            if scores is not None:
                self.scores[row] = self.scores[row][:before] + list(zip(*(s[row, columns] for s in scores)))
        return self

    def kept(self):
        """Each row's new tokens as `generate` returns them without text (`text.token_row`)."""
        return [token_row(new, finish, cut) for new, finish, cut in zip(self.new, self.finish, self.cut)]

    @property
    def running(self):
        return self.finish == 0


def _in_window(loop, prompts, length, n_ctx, chunk, progress):
    """The pieces (`_Found` after each) of a request that fits the window n_ctx: one, or one per
    `chunk` new tokens."""
    prompt_len, total = (int(n) for n in bucket_sizes(max(map(len, prompts)), length, n_ctx))
    padded, pad = _padded(prompts, prompt_len)
    weights = loop.generator.weights_for(length, len(prompts), prompt_len)
    args = (weights, padded, pad, tf.zeros([len(prompts), total], tf.int32))
    found = _Found(len(prompts))
    if chunk is None:
        yield found.take(loop.run(args, length), prompt_len, 0)
        return
    for state in _pieces(loop, args, prompt_len, length, chunk, progress):
        yield found.take(state, prompt_len, 0)


def _padded(prompts, prompt_len):
    """The prompts left-padded to prompt_len (a tensor [batch, prompt_len]) and each row's padding."""
    padded = np.zeros([len(prompts), prompt_len], np.int32)
    for row, p in enumerate(prompts):
        padded[row, prompt_len - len(p):] = p
    return tf.constant(padded), tf.constant([prompt_len - len(p) for p in prompts], tf.int32)


def _pieces(loop, args, prompt_len, length, chunk, progress, carry=None, step=0):
    """Run the loop `chunk` new tokens at a time: yields the loop's state after each piece,
    telling `progress` (if any) the count of new tokens before and after each piece (`step`
    of them before this segment). `carry` replaces parts of the starting state (`_sliding`)."""
    state = dict(loop.start(args), **(carry or {}))
    while True:
        i = int(state["i"])
        if progress is not None:
            progress(step + i)
        if i >= length or not bool(tf.reduce_any(tf.equal(state["finish"], 0))):
            return
        state = loop.resume(args[0], state, args[2], prompt_len, min(i + chunk, length))
        yield state


def _sliding(loop, prompts, length, n_ctx, keep, chunk, progress):
    """Generation past the context window, in segments: the first runs as a `length` that fits
    would (n_ctx + 1 - the longest prompt new tokens, so its tokens are the same); each next
    one starts afresh (positions from 0) from each row's last `keep` tokens. All rows slide
    together. The step's state (the counts of new tokens, which set where each row's random
    stream is, the penalties' counts, the ended rows, the last tokens and text that a stop may
    begin in) carries over. Yields `_Found` after each piece. Every segment after the first has
    the same shapes: two compiles in all."""
    batch = len(prompts)
    found, rows, carry, step = _Found(batch), prompts, None, 0
    while True:
        longest = max(map(len, rows))
        window = n_ctx + 1 - longest
        count = min(window, length - step)
        prompt_len, total = (int(n) for n in bucket_sizes(longest, window, n_ctx))
        padded, pad = _padded(rows, prompt_len)
        args = (loop.generator.weights_for(window, batch, prompt_len), padded, pad, tf.zeros([batch, total], tf.int32))
        found.segment()
        for state in _pieces(loop, args, prompt_len, count, chunk, progress, carry, step):
            yield found.take(state, prompt_len, step)
        step += count
        if step >= length or not found.running.any():
            return
        carry = {k: v for k, v in state.items() if k in CARRIED}
        rows = [np.concatenate([p, np.asarray(n, np.int64)])[-keep:] for p, n in zip(prompts, found.new)]


CARRIED = ("count", "finish", "cut", "counts", "seen", "recent", "prefixes")  # the step's state, across a slide


def _held(controls):
    """How many of a running row's last tokens a stream holds back: those that could still
    begin a stop token sequence."""
    return int(controls["stop_ids"].shape[-1]) - 1 if "stop_ids" in controls else 0


def _streamed(pieces, held):
    """Each row's new tokens since the last piece, piece by piece (pieces: `_Found`); the last
    `held` tokens of a running row wait until they cannot be part of a stop sequence any more."""
    sent = None
    for found in pieces:
        rows = found.kept()
        new = np.array([len(row) for row in rows])
        sent = np.zeros_like(new) if sent is None else sent
        ready = np.where(found.running, np.maximum(sent, new - held), new)
        yield [np.asarray(row[start:end], np.int32) for row, start, end in zip(rows, sent, ready)]
        sent = ready


def _texts(pieces, vocabulary, request):
    """Each row's new text since the last piece, piece by piece (`decoding.text.TextStream`:
    whole characters, nothing a stop string may still claim, and a row's end as the step says)."""
    streams = []
    for found in pieces:
        if not streams:
            streams = [TextStream(vocabulary.token_bytes, request.stop) for _ in found.new]
            fed, ended = [0] * len(streams), [False] * len(streams)
        out = []
        for row, stream in enumerate(streams):
            tokens, fed[row] = found.new[row][fed[row]:], len(found.new[row])
            if ended[row]:
                out.append("")
            elif found.finish[row]:
                ended[row] = True
                out.append(stream.finish(tokens, None, found.finish[row], found.cut[row])[0])
            else:
                out.append(stream.feed(tokens)[0])
        yield out


def _prompt_scores(model, prompts, top):
    """Per prompt, each token after the first: (its log-probability, the `top` most likely ids,
    theirs), from the model's logits over the prompt; None where `top` is None."""
    if top is None:
        return None
    scored = []
    for prompt in prompts:
        logits = model(tf.constant(prompt[None], tf.int32))["logits"][0, :-1]
        chosen, (ids, values) = per_token.log_probabilities(logits, tf.constant(prompt[1:], tf.int32), top)
        scored.append(list(zip(chosen.numpy(), ids.numpy(), values.numpy())))
    return scored
