"""Stop strings on text, inside the compiled loop: a row stops as soon as its new text contains a
stop string, and its text ends before the first one (OpenAI's, vLLM's and the server's rule).

Matching is on the text's UTF-8 bytes (for valid UTF-8, the same as on its characters), from the
tokens' bytes (`Vocabulary`, the model's vocabulary as a byte matrix, a constant of the loop).
As Hugging Face's `StopStringCriteria`, it is exact wherever token boundaries fall, and
vectorised; unlike it, nothing is built per request over the vocabulary: each step compares the
picked token's bytes with the stop strings (B x S x L x (2L + W) byte comparisons for B rows,
S stop strings of at most L bytes and tokens of at most W bytes: far below the model's step),
and a row carries which prefixes of each stop string its text ends with (`prefixes`, [B, S, L]
bools: prefix m of stop s is a suffix of the text). A token that extends a prefix to a whole
stop string, or holds one within it, ends the row; the step reports where the stop string
starts, relative to the token's first byte (negative: in an earlier token).
"""
import numpy as np
import tensorflow as tf

NONE = 1 << 20  # "no stop string here" as a start offset (beyond any text a step can make)


class Vocabulary:
    """A vocabulary's token bytes as `bytes` [n_vocab, W] uint8 (W the longest token) and
    `lengths` [n_vocab] int32, for the loop (`tensors`); `token_bytes(id)` for the host."""

    def __init__(self, token_bytes):
        self.items = list(token_bytes)
        self.lengths = np.array([len(b) for b in self.items], np.int32)
        self.bytes = np.zeros([len(self.items), max(self.lengths.max(), 1)], np.uint8)
        for token, data in enumerate(self.items):
            self.bytes[token, :len(data)] = np.frombuffer(data, np.uint8)
        self._tensors = None

    @classmethod
    def of(cls, encoder):
        """The vocabulary of a `tfgpt2.encoder.Encoder`, made once per encoder."""
        if getattr(encoder, "_vocabulary", None) is None:
            encoder._vocabulary = cls([encoder.encoding.decode_single_token_bytes(t) for t in range(encoder.n_vocab)])
        return encoder._vocabulary

    def token_bytes(self, token):
        return self.items[token]

    def tensors(self):
        """(bytes, lengths) as constants, made once."""
        if self._tensors is None:
            self._tensors = (tf.constant(self.bytes), tf.constant(self.lengths))
        return self._tensors


def stop_bytes(rows, count=None, width=None):
    """Each row's stop strings (a list of texts per row) as the loop takes them: bytes [B, S, L]
    int32 (-1 past each string's end) and lengths [B, S] (0: no string), S and L the powers of
    two (from 1 and 4) that hold the most strings of a row and the longest string (so XLA
    compiles once per such shape), or `count` and `width` where given."""
    encoded = [[s.encode("utf-8") for s in row] for row in rows]
    count = count or _power_of_two(max(map(len, encoded)), 1)
    width = width or _power_of_two(max((len(s) for row in encoded for s in row), default=1), 4)
    data = np.full([len(rows), count, width], -1, np.int32)
    lengths = np.zeros([len(rows), count], np.int32)
    for r, row in enumerate(encoded):
        for s, text in enumerate(row):
            data[r, s, :len(text)] = np.frombuffer(text, np.uint8)
            lengths[r, s] = len(text)
    return data, lengths


def _power_of_two(n, least):
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def no_prefixes(stops):
    """The prefixes state of rows whose text is empty (`stops` [B, S, L]): none."""
    return tf.zeros(tf.shape(stops), tf.bool)


def advanced(prefixes, token, stops, lengths, vocabulary):
    """The text's new prefixes after `token` [B], and where the first stop string it completes
    starts (bytes from the token's first, negative in earlier tokens; NONE where it completes
    none) with that stop string's length, each [B]. `stops` [B, S, L] and `lengths` [B, S] as
    `stop_bytes` makes them; `vocabulary`: `Vocabulary.tensors()`."""
    data, sizes = vocabulary
    width = tf.shape(stops)[-1]
    n = tf.gather(sizes, token)
    head, tail, whole = _token_views(tf.gather(data, token), n, width)
    n3, sl = n[:, None, None], lengths[:, :, None]
    m = tf.range(width)[None, None, :]  # a prefix's length: where the token would go on from
    fits = _fits(head, n, stops, lengths)
    have = tf.concat([tf.ones_like(prefixes[..., :1]), prefixes[..., 1:]], -1)  # prefix 0, the empty one, always
    completes = have & fits & (m >= 1) & (m + n3 >= sl)
    grows = have & fits & (m + n3 < sl)  # prefix m becomes prefix m + n
    extended = tf.gather(grows, tf.broadcast_to(tf.maximum(m - n3, 0), tf.shape(grows)), batch_dims=2) & (m >= n3)
    prefixes = (extended | (_ends_with(tail, stops) & (m < n3) & (m < sl))) & (m >= 1)
    start = tf.where(tf.reduce_any(completes, -1), -tf.reduce_max(tf.where(completes, m, -1), -1),
                     _first_inside(whole, n, stops, lengths))
    return prefixes, _earliest(start, lengths)


def _token_views(data, n, width):
    """A token's bytes [B, W] (-2 past its end) as `head` [B, L] (its first L bytes), `tail`
    [B, L] (its last L bytes, right-aligned, -2 before its first) and `whole` [B, W], int32."""
    whole = tf.where(tf.range(tf.shape(data)[1])[None] < n[:, None], tf.cast(data, tf.int32), -2)
    padded = tf.pad(whole, [[0, 0], [0, width]], constant_values=-2)
    at = n[:, None] - width + tf.range(width)[None]
    tail = tf.where(at >= 0, tf.gather(padded, tf.maximum(at, 0), batch_dims=1), -2)
    return padded[:, :width], tail, whole


def _fits(head, n, stops, lengths):
    """[B, S, L]: whether the token's bytes go on stop string s from its byte m (the last axis),
    as far as both reach."""
    width = tf.shape(stops)[-1]
    m, k = tf.range(width)[:, None], tf.range(width)[None, :]
    ahead = tf.gather(stops, tf.minimum(m + k, width - 1), axis=2)  # [B, S, m, k]: stop byte m + k
    same = ((head[:, None, None, :] == ahead) | (k >= n[:, None, None, None])
            | (m + k >= lengths[:, :, None, None]))
    return tf.reduce_all(same, -1) & (tf.range(width)[None, None] < lengths[..., None])


def _ends_with(tail, stops):
    """[B, S, L]: whether the token's bytes end with the first j bytes of stop string s (j the
    last axis; only meaningful for j <= the token's length)."""
    width = tf.shape(stops)[-1]
    j, k = tf.range(width)[:, None], tf.range(width)[None, :]
    theirs = tf.gather(tail, tf.minimum(width - j + k, width - 1), axis=1)  # [B, j, k]: the byte facing stop byte k
    return tf.reduce_all((theirs[:, None] == stops[:, :, None, :]) | (k >= j), -1)


def _first_inside(whole, n, stops, lengths):
    """[B, S]: the first offset in the token at which a whole stop string sits, else NONE."""
    width, size = tf.shape(stops)[-1], tf.shape(whole)[1]
    o = tf.range(size)[:, None]  # [W, 1]
    k = tf.range(width)[None, :]  # [1, L]
    window = tf.gather(tf.pad(whole, [[0, 0], [0, width]], constant_values=-2), o + k, axis=1)  # [B, W, L]
    same = (window[:, None] == stops[:, :, None, :]) | (k >= lengths[:, :, None, None])  # [B, S, W, L]
    found = tf.reduce_all(same, -1) & (o[:, 0] + lengths[..., None] <= n[:, None, None]) & (lengths[..., None] > 0)
    return tf.reduce_min(tf.where(found, tf.range(size), NONE), -1)


def _earliest(start, lengths):
    """Per row, the earliest start among the stop strings (the shortest where two start
    together) and that string's length."""
    key = start * 128 + tf.minimum(lengths, 127)  # starts first, then lengths (at most MAX_STOP_BYTES)
    best = tf.argmin(tf.where(start < NONE, key, NONE * 128), axis=-1, output_type=tf.int32)
    return tf.gather(start, best, batch_dims=1), tf.gather(lengths, best, batch_dims=1)
