"""The one per-token step of generation, which every loop calls: the whole batch's compiled loop
(`generator`), the server's slots (`slots`) and the LiteRT loop (`formats.litert`, on the logits
its file returns). Per row: the logits adjusted by the controls (`controls.adjusted`, and before
`min_tokens` new tokens, end-of-text and one-token stops banned), a token picked by the sampler
(`sampler.choose`, token j of a row drawing with (its seed, j)), counted, and the row ended at its
length, at end-of-text (`stop_at_eot`), at a stop token sequence or at a stop string on its text
(`stops`); the log-probabilities of the model's distribution where asked (`top`).

`controls_for` turns one `request.Request` per row into the controls, a dict of per-row tensors
holding only what the requests use (a dict's keys are part of what `tf.function` traces: a
request without stop strings runs the loop it ran before they existed, and values never cause a
compile), and `begin` makes a step's state. A row's end is `finish` (LENGTH, EOT, STOP or
STOP_TEXT; 0 while it runs) with `cut`: the stop token sequence's tokens, or the stop string's
bytes from the end of the text, to leave out (`include_stop_str_in_output` keeps the stop: then
nothing, or the bytes after the stop string); `text.kept` applies them on the host.
"""
import numpy as np
import tensorflow as tf

from . import controls as control
from . import stops as text_stops
from .request import MAX_LOGPROBS
from .sampler import choose

LENGTH, EOT, STOP, STOP_TEXT = 1, 2, 3, 4  # why a row ended (`finish`; STOP: a token sequence); 0: running
ALWAYS = ("temperature", "top_k", "top_p", "seed", "length", "stop_at_eot")  # every request's, per row


def controls_for(requests, n_vocab, vocabulary=None):
    """The controls of rows generated with `requests` (one `request.Request` per row, the row's
    seed in it), and `choose`'s filters (Python bools: whether any row uses top-k, top-p).
    `vocabulary`: a `stops.Vocabulary`, needed where a request has stop strings."""
    controls = {name: tf.constant([getattr(r, name) for r in requests], dtype) for name, dtype in zip(
        ALWAYS, (tf.float32, tf.int32, tf.float32, tf.int64, tf.int32, tf.bool))}
    controls["eot"] = tf.constant(requests[0].eot, tf.int32)
    if any(r.logit_bias for r in requests):
        bias = np.zeros([len(requests), n_vocab], np.float32)
        for row, r in enumerate(requests):
            for token, value in r.logit_bias:
                bias[row, token] = value
        controls["bias"] = tf.constant(bias)
    used = {key for key, field in control.PENALTIES.items() if any(getattr(r, field) != control.OFF[key]
                                                                    for r in requests)}
    if {"presence", "frequency"} & used:  # one control, as OpenAI's formula
        used |= {"presence", "frequency"}
    for key in sorted(used):
        controls[key] = tf.constant([getattr(r, control.PENALTIES[key]) for r in requests], tf.float32)
    if any(r.min_p for r in requests):
        controls["min_p"] = tf.constant([r.min_p for r in requests], tf.float32)
    controls.update(_stop_controls(requests, vocabulary))
    return controls, (any(r.top_k for r in requests), any(r.top_p < 1 for r in requests))


def _stop_controls(requests, vocabulary):
    """The controls of stop token sequences, stop strings and min_tokens, where used."""
    controls = {}
    if any(r.stop_token_ids for r in requests):
        longest = max(len(s) for r in requests for s in r.stop_token_ids)
        dense = np.full([len(requests), max(len(r.stop_token_ids) for r in requests), longest], -1, np.int32)
        for row, r in enumerate(requests):
            for n, sequence in enumerate(r.stop_token_ids):
                dense[row, n, :len(sequence)] = sequence
        controls["stop_ids"] = control.aligned_stops(tf.constant(dense))
    if any(r.stop for r in requests):
        if vocabulary is None:
            raise ValueError("stop strings need the model's vocabulary (its encoder)")
        data, lengths = text_stops.stop_bytes([r.stop for r in requests])
        controls.update(stops=tf.constant(data), stop_lengths=tf.constant(lengths), vocabulary=vocabulary.tensors())
    if controls and any(r.include_stop_str_in_output for r in requests):
        controls["include_stop"] = tf.constant([r.include_stop_str_in_output for r in requests])
    if any(r.min_tokens for r in requests):
        ends = [([r.eot] if r.stop_at_eot else []) + [s[0] for s in r.stop_token_ids if len(s) == 1] for r in requests]
        dense = np.full([len(requests), max(1, max(map(len, ends)))], -1, np.int32)
        for row, tokens in enumerate(ends):
            dense[row, :len(tokens)] = tokens
        controls.update(min_tokens=tf.constant([r.min_tokens for r in requests], tf.int32), ends=tf.constant(dense))
    return controls


def begin(controls, prompt, pad, n_vocab, count=None):
    """The state of rows about to make their first new token (`count` [B] of them made before,
    default 0) after the prompts `prompt` [B, P], left-padded by `pad` [B] slots: each row's
    count, whether it has ended (`finish`), what to leave out (`cut`), and what the controls
    keep (the penalties' counts, the last tokens for stop sequences, the text's prefixes of stop
    strings)."""
    batch = tf.shape(prompt)[0]
    state = dict(count=tf.zeros([batch], tf.int32) if count is None else count,
                 finish=tf.zeros([batch], tf.int32), cut=tf.zeros([batch], tf.int32),
                 **control.start_state(controls, prompt, pad, n_vocab))
    if "stop_ids" in controls:
        state["recent"] = tf.fill([batch, tf.shape(controls["stop_ids"])[-1]], -1)
    if "stops" in controls:
        state["prefixes"] = text_stops.no_prefixes(controls["stops"])
    return state


def step(logits, state, controls, *, filters=(True, True), top=None):
    """One new token for each row of `state` still running (`finish` 0), from the model's
    `logits` [B, n_vocab]: (tokens [B] (`eot` for ended rows), the new state, and, where `top`
    (a Python int, at most MAX_LOGPROBS) is given, (the log-probability of each token, the `top`
    most likely ids and theirs) of the model's distribution, before the controls). Its
    operations are named under "sampling/" (tools/profile_xla.py times them as one group)."""
    with tf.name_scope("sampling"):
        return _step(logits, state, controls, filters, top)


def _step(logits, state, controls, filters, top):
    running = tf.equal(state["finish"], 0)
    count = state["count"]
    adjusted = control.adjusted(logits, controls, state)
    if "min_tokens" in controls:  # end-of-text and one-token stops wait for min_tokens
        early = running & (count < controls["min_tokens"])
        adjusted = tf.cond(tf.reduce_any(early), lambda: _banned(adjusted, early, controls["ends"]), lambda: adjusted)
    token = choose(adjusted, temperature=controls["temperature"], top_k=controls["top_k"], top_p=controls["top_p"],
                   seed=tf.stack([controls["seed"], tf.cast(count, tf.int64)], 1), filters=filters,
                   min_p=controls.get("min_p"))
    token = tf.where(running, token, controls["eot"])
    scores = None if top is None else log_probabilities(logits, token, top)
    return token, _ended(dict(control.counted(state, token, running), count=count + tf.cast(running, tf.int32)),
                         token, running, controls), scores


def _banned(logits, rows, tokens):
    """The logits with `tokens` [B, E] (-1: none) banned in `rows` [B]."""
    banned = tf.reduce_any(tf.one_hot(tokens, tf.shape(logits)[-1], on_value=True, off_value=False), 1)
    return tf.where(rows[:, None] & banned, float("-inf"), logits)


def _ended(state, token, running, controls):
    """The state with the rows that `token` ends: a stop (its tokens or bytes to cut), else
    end-of-text, else the length."""
    count, finish, cut = state["count"], state["finish"], state["cut"]
    may_stop = running & (count >= controls["min_tokens"]) if "min_tokens" in controls else running
    keep = controls.get("include_stop", tf.zeros_like(running))
    stopped = found = tf.zeros_like(running)
    if "stop_ids" in controls:
        recent = tf.where(running[:, None], tf.concat([state["recent"][:, 1:], token[:, None]], 1), state["recent"])
        state["recent"] = recent
        size = control.stop_length(recent, 0, tf.shape(recent)[1], controls["stop_ids"])
        stopped = may_stop & (size > 0)
        cut = tf.where(stopped & ~keep, size, cut)
    if "stops" in controls:
        prefixes, (start, length) = text_stops.advanced(state["prefixes"], token, controls["stops"],
                                                        controls["stop_lengths"], controls["vocabulary"])
        state["prefixes"] = tf.where(running[:, None, None], prefixes, state["prefixes"])
        found = may_stop & ~stopped & (start < text_stops.NONE)
        end = tf.gather(controls["vocabulary"][1], token)  # the token's bytes: the text's end from its start
        cut = tf.where(found, end - tf.where(keep, start + length, start), cut)
    eot = running & ~stopped & ~found & controls["stop_at_eot"] & tf.equal(token, controls["eot"])
    full = running & ~stopped & ~found & ~eot & (count >= controls["length"])
    finish = tf.where(stopped, STOP, tf.where(found, STOP_TEXT, tf.where(eot, EOT, tf.where(full, LENGTH, finish))))
    return dict(state, finish=finish, cut=cut)


def log_probabilities(logits, token, top=MAX_LOGPROBS):
    """log softmax(logits) [batch, n_vocab] at `token` [batch], and the `top` most likely ids and
    their log-probabilities [batch, top] (by repeated arg max: no sort of the vocabulary)."""
    logp = tf.nn.log_softmax(tf.cast(logits, tf.float32))
    chosen = tf.gather(logp, token, batch_dims=1)
    ids, values, rest = [], [], logp
    for _ in range(top):
        best = tf.argmax(rest, axis=-1, output_type=tf.int32)
        ids.append(best)
        values.append(tf.gather(logp, best, batch_dims=1))
        rest = tf.tensor_scatter_nd_update(rest, tf.stack([tf.range(tf.shape(best)[0]), best], 1),
                                           tf.fill(tf.shape(best), float("-inf")))
    rows = tf.shape(logits)[0]
    return chosen, (tf.reshape(tf.stack(ids, 1), [rows, top]), tf.reshape(tf.stack(values, 1), [rows, top]))
