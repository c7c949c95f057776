"""Byte pair encoding utilities: the original GPT-2 tokenizer (src/encoder.py), run by tiktoken.

Ids are the original's for all text.  Nothing here reaches the network: the vocabulary comes
from a model folder's encoder.json and vocab.bpe, or from the copy shipped in tfgpt2/assets.
"""

import hashlib
import json
import os
from functools import lru_cache

import tiktoken

EOT = '<|endoftext|>'
EOT_TOKEN = 50256  # its id in GPT-2's encoder.json: where generation stops by default
VOCAB_FILES = ('encoder.json', 'vocab.bpe')
ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'assets')
ASSETS_SHA256 = {
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
}
# The original's pattern, unchanged: without IGNORECASE, "I'LL" splits as "I", "'", "LL".
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_encoders = {}  # (sha256 of encoder.json, sha256 of vocab.bpe) -> Encoder


class VocabularyError(ValueError):
    """encoder.json or vocab.bpe is missing, corrupt or inconsistent; the message names the file."""


@lru_cache()
def bytes_to_unicode():
    """GPT-2's map from each byte to a visible character, in rank order: the bytes that are
    visible as Latin-1 characters map to themselves, the other 68 to U+0100 onwards."""
    visible = [b for b in range(256) if chr(b).isprintable() and b != ord(' ')]
    hidden = [b for b in range(256) if b not in visible]
    table = {b: chr(b) for b in visible}
    table.update((b, chr(256 + n)) for n, b in enumerate(hidden))
    return table


class Encoder:
    """The original Encoder's API (encode, decode, encoder, decoder, bpe_ranks, errors) plus
    eot_token, n_vocab and batch helpers.  `encoding` is the tiktoken.Encoding doing the work."""

    def __init__(self, encoding, encoder, bpe_merges=(), errors='replace'):
        self.encoding = encoding
        self.encoder = encoder
        self.bpe_ranks = {tuple(merge): rank for rank, merge in enumerate(bpe_merges)}
        self.decoder = {v: k for k, v in encoder.items()}
        self.errors = errors  # how to handle invalid UTF-8 in decode
        self.eot_token = encoder[EOT]
        self.n_vocab = len(encoder)

    def encode(self, text, allowed_special=()):
        """Ids of `text`.  By default a literal '<|endoftext|>' is ordinary text, as in the
        original; allowed_special={'<|endoftext|>'} (or 'all') maps it to eot_token.  A lone
        surrogate, which the original cannot encode, is encoded as U+FFFD."""
        if not allowed_special:
            return self.encoding.encode_ordinary(text)
        return self.encoding.encode(text, allowed_special=allowed_special, disallowed_special=())

    def decode(self, tokens):
        """Text of `tokens` (ints or a 1-D array); invalid UTF-8 is handled per `errors`.
        An id outside the vocabulary raises KeyError, a negative one OverflowError."""
        return self.encoding.decode(tokens, errors=self.errors)

    def encode_batch(self, texts, allowed_special=()):
        """[encode(text) for text in texts], in this thread: tiktoken's encode_batch, one
        thread-pool task per text, measured 10x slower on many short lines."""
        return [self.encode(text, allowed_special) for text in texts]

    def decode_batch(self, batch, pad_id=None):
        """Text of each row of `batch` (lists of ids, or a 2-D numpy array).  Runs of `pad_id`
        at either end of a row are dropped; one inside a row is decoded."""
        rows = batch.tolist() if hasattr(batch, 'tolist') else batch
        if pad_id is not None:
            rows = [_strip(list(row), pad_id) for row in rows]
        return [self.decode(row) for row in rows]

    def count_tokens(self, text, allowed_special=()):
        """len(encode(text, allowed_special))."""
        return len(self.encode(text, allowed_special))


def _strip(row, pad_id):
    start, end = 0, len(row)
    while start < end and row[start] == pad_id:
        start += 1
    while end > start and row[end - 1] == pad_id:
        end -= 1
    return row[start:end]


def get_encoder(model_name, models_dir):
    """The encoder of models_dir/model_name's encoder.json and vocab.bpe, or of the shipped copy
    where the folder has neither file (or does not exist).  Raises VocabularyError where it
    has only one (`vocabulary_files`), or where they are corrupt or disagree; their sha256 is
    not checked."""
    paths = vocabulary_files(os.path.join(models_dir, model_name))
    return _load(paths) if paths else default_encoder()


def vocabulary_files(folder, names=VOCAB_FILES):
    """The paths of the vocabulary files `names` (encoder.json and vocab.bpe) in `folder`, or
    None where it has neither (or does not exist): the one rule for where a vocabulary is.
    A folder with only one of them is a VocabularyError naming the missing one (not a
    silent fallback to another vocabulary)."""
    paths = [os.path.join(folder, name) for name in names]
    present = [os.path.isfile(path) for path in paths]
    if not any(present):
        return None
    if not all(present):
        raise VocabularyError(
            f'{paths[present.index(False)]} is missing: a model folder needs both '
            f'{" and ".join(names)}, or neither to use the shipped copy')
    return paths


def load_vocabulary(paths):
    """The encoder of the two files `paths` (encoder.json and vocab.bpe, or a layout's names
    for them: Hugging Face's vocab.json and merges.txt); VocabularyError where they are corrupt
    or disagree."""
    return _load(paths)


def default_encoder():
    """The encoder of the vocabulary shipped in tfgpt2/assets, checked against its sha256."""
    return _load([os.path.join(ASSETS_DIR, name) for name in VOCAB_FILES], ASSETS_SHA256)


def _load(paths, expected_sha256=None):
    """The Encoder of these two files, built once per distinct content."""
    data = []
    for path in paths:
        with open(path, 'rb') as f:
            data.append(f.read())
    key = tuple(hashlib.sha256(d).hexdigest() for d in data)
    for path, digest in zip(paths, key):
        expected = expected_sha256 and expected_sha256[os.path.basename(path)]
        if expected and digest != expected:
            raise VocabularyError(f'{path}: sha256 is {digest}, expected {expected}; '
                                  'the shipped vocabulary is damaged, reinstall tfgpt2')
    if key not in _encoders:
        _encoders[key] = _build(*paths, *data)
    return _encoders[key]


def _build(json_path, bpe_path, json_data, bpe_data):
    encoder = _parse_encoder(json_path, json_data)
    merges = _parse_merges(bpe_path, bpe_data)
    _check_agree(encoder, merges, json_path, bpe_path)
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(byte_decoder[c] for c in token): i
             for token, i in encoder.items() if token != EOT}
    encoding = tiktoken.Encoding(
        'gpt2-local', pat_str=PAT_STR, mergeable_ranks=ranks,
        special_tokens={EOT: encoder[EOT]}, explicit_n_vocab=len(encoder))
    return Encoder(encoding, encoder, merges)


def _parse_encoder(path, data):
    try:
        encoder = json.loads(data)
    except ValueError as e:
        raise VocabularyError(f'{path}: not valid JSON ({e})') from None
    if not isinstance(encoder, dict) or not all(type(i) is int for i in encoder.values()):
        raise VocabularyError(f'{path}: not a JSON object of token -> integer id')
    if EOT not in encoder:
        raise VocabularyError(f'{path}: has no {EOT}')
    if sorted(encoder.values()) != list(range(len(encoder))):
        raise VocabularyError(f'{path}: ids are not 0..{len(encoder) - 1}, each once')
    alphabet = set(bytes_to_unicode().values())
    for token in encoder:
        if not set(token) <= alphabet:
            raise VocabularyError(f'{path}: token {token!r} is not in the byte alphabet')
    return encoder


def _parse_merges(path, data):
    """The merges, one pair per line after the '#version' line."""
    try:
        lines = data.decode('utf-8').splitlines()[1:]
    except UnicodeDecodeError as e:
        raise VocabularyError(f'{path}: not valid UTF-8 ({e})') from None
    merges = [line.split() for line in lines]
    for number, merge in enumerate(merges, 2):
        if len(merge) != 2:
            raise VocabularyError(
                f'{path}: line {number} is not two symbols: {lines[number - 2]!r}')
    return merges


def _check_agree(encoder, merges, json_path, bpe_path):
    """Raise unless the ids are the ranks: the 256 bytes, then each merge in order, then EOT.
    tiktoken merges by these ranks, which gives the original's merges only where they agree."""
    tokens = list(bytes_to_unicode().values()) + [first + second for first, second in merges]
    if len(tokens) + 1 != len(encoder):
        raise VocabularyError(
            f'{json_path} has {len(encoder)} tokens but {bpe_path} has {len(merges)} merges '
            f'(expected 256 bytes + merges + {EOT})')
    for rank, token in enumerate(tokens):
        if encoder.get(token) != rank:
            where = f'line {rank - 254} of {bpe_path}' if rank >= 256 else 'a single byte'
            raise VocabularyError(
                f'{bpe_path} does not match {json_path}: {token!r} ({where}) '
                f'should have id {rank}, has {encoder.get(token)}')
