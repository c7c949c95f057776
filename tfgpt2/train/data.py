"""Training data as the fine-tuning forks of `openai/gpt-2` read it: chunks of token ids and
windows drawn from them at random, never across a chunk's end.

A dataset is a text file, a folder (every file under it), a glob, or an `.npz` of chunks as
`tfgpt2 encode` (as the forks' `encode.py`) writes them: `np.savez_compressed`
with arrays `arr_0`, `arr_1`, ... Text files are joined with `<|endoftext|>` until at least
`combine` characters, then encoded as one chunk; a literal `<|endoftext|>` in a text is the
end-of-text token.

Windows are drawn by stateless random ops from (seed, step), so the windows of a step do not
depend on what ran before it: a resumed run sees the same windows as an uninterrupted one.
"""
import glob
import os
import zipfile
import zlib

import numpy as np
import tensorflow as tf

from ..encoder import EOT
from ..inputs import in_vocabulary


class DatasetError(ValueError):
    """A dataset that cannot be read, or that cannot give a single window."""


def dataset_paths(path):
    """The files a dataset names: the file itself, every file under a folder, or a glob's
    matches, sorted."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        paths = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    else:
        paths = [p for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
    if not paths:
        raise DatasetError(f"{path}: no such file, or no files in that folder or glob")
    return sorted(paths)


def check_encoding(name):
    """`name` if it names a text encoding Python knows (utf-8, latin-1, cp1252, ...), else ValueError."""
    try:
        "x".encode(name)  # LookupError for an unknown name, or a codec that is no text encoding (rot13)
    except LookupError:
        raise ValueError(f"unknown text encoding {name!r} (for example utf-8, latin-1, cp1252)") from None
    return name


def read_text(path, encoding="utf-8"):
    try:
        with open(path, encoding=encoding) as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not valid {encoding} at byte {e.start} "
                           f"(pass --encoding, e.g. --encoding latin-1)") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None


def load_npz(path, n_vocab=None):
    """The chunks of an `.npz` (arr_0, arr_1, ... in that order), checked: 1-D integer ids
    in [0, n_vocab)."""
    try:
        with np.load(path) as npz:
            names = sorted(npz.files, key=lambda n: (len(n), n))
            chunks = [npz[name] for name in names]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # a truncated or damaged file
        raise DatasetError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    for name, chunk in zip(names, chunks):
        if chunk.ndim != 1 or not np.issubdtype(chunk.dtype, np.integer):
            raise DatasetError(f"{path}: {name} is {chunk.dtype} of shape {list(chunk.shape)}; "
                               "expected a 1-D array of token ids")
        check_ids(chunk, n_vocab, f"{path}: {name}")
    return [chunk.astype(np.int32) for chunk in chunks]


def check_ids(chunk, n_vocab, where):
    """Every id of `chunk` in [0, n_vocab) (`inputs.in_vocabulary`; n_vocab None: >= 0 and
    int32), else DatasetError naming the first bad one."""
    bad = np.flatnonzero(~in_vocabulary(chunk, n_vocab or np.iinfo(np.int32).max))
    if bad.size:
        raise DatasetError(f"{where}[{bad[0]}] is token id {chunk[bad[0]]}, outside [0, n_vocab={n_vocab})")


def load_dataset(enc, path, *, combine=50000, encoding="utf-8", n_vocab=None):
    """The list of chunks (1-D int32 arrays of token ids) a dataset holds, each id checked
    against `n_vocab` (a model with a smaller vocabulary than the encoder's)."""
    chunks, texts, size = [], [], 0

    def flush():
        nonlocal texts, size
        if texts:
            chunks.append(np.asarray(enc.encode(EOT.join(texts), allowed_special={EOT}), np.int32))
            check_ids(chunks[-1], n_vocab, f"{path}: encoded text, chunk {len(chunks) - 1}")
        texts, size = [], 0

    for p in dataset_paths(path):
        if p.endswith(".npz"):
            chunks.extend(load_npz(p, n_vocab))
            continue
        texts.append(read_text(p, encoding))
        size += len(texts[-1])
        if size >= combine:
            flush()
    flush()
    return [c for c in chunks if c.size]


def scored_tokens(enc, path, *, encoding="utf-8", n_vocab=None):
    """(token ids, the UTF-8 bytes they stand for) of a text file, or of an `.npz` of chunks,
    to score (`tfgpt2 evaluate`): the text, or each chunk, after an <|endoftext|>, so that its
    first token is scored too."""
    if path.endswith(".npz"):
        chunks = load_npz(path, n_vocab)
        n_bytes = sum(len(enc.encoding.decode_bytes(chunk.tolist())) for chunk in chunks)
    else:
        text = read_text(path, encoding)
        chunks, n_bytes = [enc.encode(text)], len(text.encode("utf-8"))
    tokens = []
    for chunk in chunks:
        tokens += [enc.eot_token, *map(int, chunk)] if len(chunk) else []
    if len(tokens) < 2:
        raise DatasetError(f"{path}: no text to evaluate")
    return tokens, n_bytes


def split_validation(chunks, fraction):
    """(train, held out): the last `fraction` of the tokens, taken from the end of the chunk
    list (a chunk that straddles the cut becomes two), so no window holds tokens of both."""
    total = sum(c.size for c in chunks)
    keep = total - int(round(total * fraction))
    train, held_out, seen = [], [], 0
    for c in chunks:
        cut = min(max(keep - seen, 0), c.size)
        train.append(c[:cut])
        held_out.append(c[cut:])
        seen += c.size
    return [c for c in train if c.size], [c for c in held_out if c.size]


class Windows:
    """Every window of `length` tokens that lies inside one chunk, numbered 0 .. count-1.

    The chunks are concatenated into `tokens`; window i starts at `starts(i)`. Drawing i
    uniformly from [0, count) is the forks' sampler: uniform over positions, never across a
    chunk's end.
    """

    def __init__(self, chunks, length, *, name="dataset"):
        sizes = np.array([c.size for c in chunks], np.int64)
        fits = np.maximum(sizes - length + 1, 0)
        if not fits.sum():
            raise DatasetError(
                f"{name}: {int(sizes.sum())} tokens in {len(chunks)} chunks, the longest "
                f"{int(sizes.max()) if sizes.size else 0}; a training window needs {length} tokens "
                "within one chunk (use a larger dataset, a larger --combine or a shorter --sample_length)")
        self.length, self.count = length, int(fits.sum())
        self.tokens = tf.constant(np.concatenate(chunks).astype(np.int32))
        # window i lies in chunk c where first[c] <= i < first[c+1], at offset i - first[c]
        used = fits > 0
        self.first = tf.constant((np.cumsum(fits) - fits)[used])
        self.offset = tf.constant((np.cumsum(sizes) - sizes)[used])

    def starts(self, index):
        """Token offsets in `tokens` of windows `index` (an int64 tensor or array)."""
        chunk = tf.searchsorted(self.first, tf.reshape(index, [-1]), side="right") - 1
        start = tf.gather(self.offset, chunk) + tf.reshape(index, [-1]) - tf.gather(self.first, chunk)
        return tf.reshape(start, tf.shape(index))

    def take(self, index):
        """The windows `index` [...] as token ids [..., length]."""
        return tf.gather(self.tokens, self.starts(index)[..., None] + tf.range(self.length, dtype=tf.int64))

    def draw(self, seed, step, n):
        """n window numbers for training step `step`, from (seed, step) alone."""
        return tf.random.stateless_uniform([n], seed=tf.stack([tf.cast(seed, tf.int64), step]),
                                           minval=0, maxval=self.count, dtype=tf.int64)


def training_dataset(windows, *, batch_size, seed, start_step=0, steps=None):
    """A tf.data pipeline of batches [batch_size, length] for steps start_step+1, +2, ...
    (up to `steps`), each drawn from (seed, step): static shapes, the same windows for a step
    however the run was interrupted."""
    end = np.iinfo(np.int64).max if steps is None or steps < 0 else steps + 1
    ds = tf.data.Dataset.range(start_step + 1, end)
    ds = ds.map(lambda step: windows.take(windows.draw(seed, step, batch_size)))
    return ds.prefetch(tf.data.AUTOTUNE)


def noised(tokens, p, n_vocab, seed):
    """The forks' --noise: each of `tokens` replaced, with probability p, by an id drawn uniformly
    from [0, n_vocab); stateless from `seed` (int64 [2])."""
    swap_seed, id_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    swap = tf.random.stateless_uniform(tf.shape(tokens), swap_seed) < p
    ids = tf.random.stateless_uniform(tf.shape(tokens), id_seed, minval=0, maxval=n_vocab, dtype=tokens.dtype)
    return tf.where(swap, ids, tokens)


def keras_dataset(windows, *, batch_size, seed, steps=None):
    """For `model.fit`: (x, y) = (window[:, :-1], window[:, 1:]), the forks' loss as a plain
    Keras loss (`SparseCategoricalCrossentropy(from_logits=True)`)."""
    return training_dataset(windows, batch_size=batch_size, seed=seed, steps=steps).map(
        lambda w: (w[:, :-1], w[:, 1:]))


def fixed_batches(windows, *, batch_size, count, seed=1):
    """`count` batches [count, batch_size, length] drawn once (validation, as the forks: a
    fixed set of random windows)."""
    index = tf.random.stateless_uniform([count, batch_size], seed=[seed, 0], minval=0,
                                        maxval=windows.count, dtype=tf.int64)
    return windows.take(index).numpy()
