"""Generation controls past the original's temperature, top-k and top-p, as the per-token step
(`step`) applies them inside the compiled loop: logit bias, repetition, presence and frequency
penalties, and stop token sequences.

Controls are a dict of per-row tensors holding only the controls a request uses (`step` lists
them all; a dict's keys are part of what `tf.function` traces, so a request without them runs
the loop it ran before they existed, and their values never cause a compile). Those here:

- "bias" float32 [batch, n_vocab], added to the logits; a value <= -100 bans the token.
- "repetition" float32 [batch]: CTRL's penalty over the tokens of the prompt and so far.
- "presence", "frequency" float32 [batch] (together): OpenAI's penalties over the counts of
  the tokens generated so far.
- "stop_ids" int32 [batch, S, L], stop token sequences right-aligned (`aligned_stops`): a row
  ends as soon as its new tokens end with one (`stop_length`).

`assert_controls` holds their checks as graph ops, for the SavedModel; `request.check_request`
checks the same rules in Python.
"""
import tensorflow as tf

from ..inputs import in_vocabulary
from .request import BANNED, in_range, require


PENALTIES = {"repetition": "repetition_penalty", "presence": "presence_penalty", "frequency": "frequency_penalty"}
"""The penalties' keys in the controls, and the request's fields they come from."""
OFF = {"repetition": 1.0, "presence": 0.0, "frequency": 0.0}  # each penalty's value that leaves the logits alone


def assert_controls(controls, n_vocab):
    """The checks of the controls in `controls` (user-side names in the messages): stop
    sequences as `aligned_stops` takes them, padded with -1 at the end of each."""
    checks = []
    if "bias" in controls:
        bias = controls["bias"]
        checks += [
            require(tf.equal(tf.shape(bias)[-1], n_vocab), f"logit_bias must have n_vocab={n_vocab} values per row",
                    tf.shape(bias)),
            in_range("logit_bias", bias, "logit_bias values"),
            require(tf.reduce_any(bias > BANNED, axis=-1), "logit_bias bans every token"),
        ]
    for key, field in PENALTIES.items():
        if key in controls:
            checks.append(in_range(field, controls[key]))
    for key in ("min_p", "min_tokens"):
        if key in controls:
            checks.append(in_range(key, controls[key]))
    if "stop_ids" in controls:
        stop = controls["stop_ids"]
        real = stop >= 0
        bad = tf.logical_not(in_vocabulary(stop, n_vocab) | (stop == -1))
        checks += [
            require(tf.logical_not(bad), f"stop token ids must be in [0, n_vocab={n_vocab}) (-1 pads)",
                    _some(stop, bad)),
            require(tf.logical_not(real[..., 1:] & tf.logical_not(real[..., :-1])),
                    "stop sequences must be padded with -1 at their end only"),
        ]
    return checks


def _some(x, where):
    """Up to three of the values of x where `where` holds, for an error message."""
    return tf.boolean_mask(tf.reshape(x, [-1]), tf.reshape(where, [-1]))[:3]


def aligned_stops(stop):
    """Stop sequences [batch, S, L] padded with -1 at the end, as [batch, S', L'] padded at the
    start (so that each ends at the last column), S' and L' the powers of two that hold S and L
    (XLA compiles once per such shape, not per count of stop sequences)."""
    lengths = tf.reduce_sum(tf.cast(stop >= 0, tf.int32), axis=-1, keepdims=True)
    width = tf.shape(stop)[-1]
    source = tf.range(width) - (width - lengths)  # column j takes column j - (width - length)
    aligned = tf.where(source >= 0, tf.gather(stop, tf.maximum(source, 0), batch_dims=2), -1)
    count, longest = _power_of_two(tf.shape(stop)[1]), _power_of_two(width)
    return tf.pad(aligned, [[0, 0], [0, count - tf.shape(stop)[1]], [longest - width, 0]], constant_values=-1)


def _power_of_two(n):
    return tf.cast(2 ** tf.math.ceil(tf.math.log(tf.cast(tf.maximum(n, 1), tf.float32)) / tf.math.log(2.0)), tf.int32)


def start_state(controls, prompt, pad, n_vocab):
    """What the penalties keep in the loop's state: "counts" [batch, n_vocab] of the tokens
    generated so far and, for the repetition penalty, "seen": the prompt's tokens (the left
    padding of `pad` [batch] slots left out)."""
    if not {"repetition", "presence"} & set(controls):
        return {}
    batch, prompt_len = tf.shape(prompt)[0], tf.shape(prompt)[1]
    state = dict(counts=tf.zeros([batch, n_vocab], tf.int32))
    if "repetition" in controls:
        rows = tf.tile(tf.range(batch)[:, None], [1, prompt_len])
        real = tf.cast(tf.range(prompt_len)[None] >= pad[:, None], tf.int32)
        indices = tf.reshape(tf.stack([rows, prompt], axis=-1), [-1, 2])
        state["seen"] = tf.tensor_scatter_nd_add(state["counts"], indices, tf.reshape(real, [-1])) > 0
    return state


def counted(state, token, running):
    """`state` with `token` [batch] added to the counts of the `running` rows."""
    if "counts" not in state:
        return state
    rows = tf.range(tf.shape(token)[0])
    return dict(state, counts=tf.tensor_scatter_nd_add(state["counts"], tf.stack([rows, token], axis=1),
                                                       tf.cast(running, tf.int32)))


def adjusted(logits, controls, state):
    """The float32 logits [batch, n_vocab] after the bias, then the repetition penalty, then
    the presence and frequency penalties; where the controls hold "adjusting" (a bool: whether
    any row uses them, the server's slots), only then."""
    if "adjusting" in controls:
        rest = {k: v for k, v in controls.items() if k != "adjusting"}
        return tf.cond(controls["adjusting"], lambda: adjusted(logits, rest, state), lambda: logits)
    if "bias" in controls:
        bias = controls["bias"]
        logits = logits + tf.where(bias <= BANNED, float("-inf"), bias)
    if "repetition" in controls:
        p = controls["repetition"][:, None]
        seen = tf.logical_or(state["seen"], state["counts"] > 0)
        logits = tf.where(seen, tf.where(logits > 0, logits / p, logits * p), logits)
    if "presence" in controls:
        counts = tf.cast(state["counts"], tf.float32)
        logits = logits - (controls["frequency"][:, None] * counts
                           + controls["presence"][:, None] * tf.cast(counts > 0, tf.float32))
    return logits


def stop_length(tokens, start, end, stop):
    """Per row, the length of the longest of the `stop` sequences (`aligned_stops`) that the new
    tokens tokens[:, start:end] end with; 0 where none (`start` a scalar or [batch, 1])."""
    width = tf.shape(stop)[-1]
    columns = end - width + tf.range(width)
    window = tf.where(columns >= start, tf.gather(tokens, tf.maximum(columns, 0), axis=1), -2)
    match = tf.reduce_all((stop == -1) | (stop == window[:, None, :]), axis=-1)
    lengths = tf.reduce_sum(tf.cast(stop >= 0, tf.int32), axis=-1)
    return tf.reduce_max(tf.where(match & (lengths > 0), lengths, 0), axis=-1)
