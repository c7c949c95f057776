"""tfgpt2.encoder against OpenAI's src/encoder.py on the shared vocabulary."""
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.helpers import REFERENCE_SRC, SHARED, require_reference
from tfgpt2 import encoder as E

EOT = '<|endoftext|>'
CORPUS = [
    '',
    'Every effort moves you',
    'Hello, world!',
    '你好，世界。日本語のテキストも、한국어 문장도.',
    'مرحبا بالعالم، שלום עולם',
    'नमस्ते दुनिया, สวัสดีครับ, Ελληνικά, Привет мир',
    'e\u0301 a\u0308\u0323 Z\u0351\u0352\u0353 \u0301 alone',
    '👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️ 🙂🙂',
    'a  b   c\t\td\n\n\ne \r\n f',
    '   leading, trailing   ',
    ' ', '\n', '\t \n \t', '\n\n\n\n', ' \u3000\xa0\u2028 odd spaces',
    "I'LL don't DON'T they're THEY'RE we've WE'VE I'm I'M she'd SHE'D it's IT'S can't",
    "'s 's's'''' 'll''ve 'S ' s",
    '3.14159 1,000,000 2024-01-01 0x1F 1e-9 ١٢٣ ²³ Ⅻ 10000000000000000000000',
    'def f(x):\n    """Doc."""\n    return {"a": [x ** 2, x // 3]}  # note\n',
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }\n',
    '<div class="x">&amp; &#x27;</div>\n{"key": null, "list": [1, 2.5e3]}',
    'a' * 5000,
    'supercalifragilistic' * 250,
    ' ' + '7' * 5000,
    ' ' * 5000 + 'x',
    '🙂' * 1000,
    EOT,
    'Hello, world! ' + EOT,
    EOT + EOT + 'a<|endoftext',
    '\x00\x01\x1c\x1d\x1e\x1f\x7f\x85 control',
]


@pytest.fixture(scope='module')
def reference():
    """OpenAI's Encoder on SHARED/gpt2-vocab."""
    require_reference()
    pytest.importorskip('regex', reason='the reference encoder.py needs the regex package')
    if not (SHARED / 'gpt2-vocab' / 'vocab.bpe').is_file():
        pytest.skip(f'shared vocabulary not found at {SHARED / "gpt2-vocab"}')
    spec = importlib.util.spec_from_file_location('reference_encoder', REFERENCE_SRC / 'encoder.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def pair(reference):
    """(reference Encoder, ours), both built from SHARED/gpt2-vocab."""
    return (reference.get_encoder('gpt2-vocab', str(SHARED)),
            E.get_encoder('gpt2-vocab', str(SHARED)))


@pytest.fixture(scope='module')
def enc():
    return E.default_encoder()


@pytest.mark.parametrize('text', CORPUS, ids=range(len(CORPUS)))
def test_corpus_ids_match_reference_and_round_trip(pair, text):
    ref, ours = pair
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == text
    assert ours.count_tokens(text) == len(ids)


def test_literal_eot_is_text_by_default(pair):
    ref, ours = pair
    assert ours.eot_token == 50256 and ours.n_vocab == 50257
    ids = ours.encode(EOT)
    assert ids == ref.encode(EOT) and 50256 not in ids and len(ids) > 1
    assert ours.encode(EOT, allowed_special={EOT}) == ours.encode(EOT, 'all') == [50256]
    assert ours.decode([50256]) == ref.decode([50256]) == EOT


def test_vocabulary_matches_reference(reference, pair):
    ref, ours = pair
    assert ours.encoder == ref.encoder
    assert ours.decoder == ref.decoder
    assert list(E.bytes_to_unicode().items()) == list(reference.bytes_to_unicode().items())


@pytest.mark.parametrize('text, ids, allowed', [
    ('Every effort moves you', [6109, 3626, 6100, 345], ()),
    ('Every day holds a', [6109, 1110, 6622, 257], ()),
    ('Hello, world! ' + EOT, [15496, 11, 995, 0, 220, 50256], {EOT}),
])
def test_known_ids(enc, text, ids, allowed):
    assert enc.encode(text, allowed_special=allowed) == ids
    assert enc.decode(ids) == enc.decode(np.array(ids, dtype=np.int32)) == text


def test_invalid_utf8_is_replaced(pair):
    ref, ours = pair
    smile = ours.encode('🙂')
    assert len(smile) > 1
    lone_byte = [ours.encoder[E.bytes_to_unicode()[0xff]]]
    for ids in (smile[:1], smile[1:], lone_byte, smile[:1] + ours.encode(' ok')):
        assert ours.decode(ids) == ref.decode(ids)
        assert '\ufffd' in ours.decode(ids)


def test_lone_surrogate_is_encoded_as_replacement_character(pair):
    ref, ours = pair
    with pytest.raises(UnicodeEncodeError):
        ref.encode('a\ud800')
    assert ours.encode('a\ud800') == ours.encode('a\ufffd')


# Characters where the pattern's alternatives meet: apostrophes, letters, digits, spaces.
TRICKY = st.sampled_from(list("'sStTlLvVmMdDrRe 1.!é中🙂\u200d\u0301")
                         + list('\t\n\r\x0b\x0c\xa0\u3000\u2028\x85'))


@settings(max_examples=400, deadline=None)
@given(st.text() | st.text(TRICKY, max_size=40))
def test_arbitrary_text_matches_reference(pair, text):
    ref, ours = pair
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50256), max_size=30))
def test_arbitrary_ids_decode_as_reference(pair, ids):
    ref, ours = pair
    assert ours.decode(ids) == ref.decode(ids)


def test_batch_helpers(enc):
    assert enc.encode_batch(CORPUS) == [enc.encode(text) for text in CORPUS]
    assert enc.encode_batch([EOT], allowed_special='all') == [[50256]]
    assert enc.encode_batch([EOT]) == [enc.encode(EOT)]
    assert enc.decode_batch(enc.encode_batch(CORPUS)) == CORPUS


def test_decode_batch_strips_pad_at_either_end(enc):
    hello, pad = enc.encode('Hello, world'), enc.eot_token
    rows = np.array([[pad, pad] + hello, hello + [pad, pad], hello[:1] + [pad, pad] + hello[1:]])
    assert enc.decode_batch(rows, pad_id=pad) == ['Hello, world', 'Hello, world',
                                                  'Hello' + EOT * 2 + ', world']
    assert enc.decode_batch(rows[:1])[0] == EOT * 2 + 'Hello, world'
    assert enc.decode_batch([[pad, pad]], pad_id=pad) == ['']


# Folders: the shipped copy as fallback, the folder's own files where it has both.

def vocab_folder(tmp_path, edit_json=None, edit_bpe=None):
    """tmp_path/m holding copies of the shipped files, after edit_json(dict) and
    edit_bpe(list of lines) where given."""
    folder = tmp_path / 'm'
    folder.mkdir()
    for name in E.VOCAB_FILES:
        (folder / name).write_bytes((Path(E.ASSETS_DIR) / name).read_bytes())
    if edit_json:
        encoder = json.loads((folder / 'encoder.json').read_text('utf-8'))
        (folder / 'encoder.json').write_text(json.dumps(edit_json(encoder)), 'utf-8')
    if edit_bpe:
        lines = (folder / 'vocab.bpe').read_text('utf-8').split('\n')
        (folder / 'vocab.bpe').write_text('\n'.join(edit_bpe(lines)), 'utf-8')
    return folder


def test_encoders_are_cached_by_content(tmp_path, enc):
    assert E.get_encoder('gpt2-vocab', str(SHARED)) is E.get_encoder('gpt2-vocab', str(SHARED))
    assert E.get_encoder('m', tmp_path) is enc
    vocab_folder(tmp_path)
    assert E.get_encoder('m', tmp_path) is enc


def test_folder_files_are_used(tmp_path, enc):
    def drop_last_merge(encoder):
        return {**{token: i for token, i in encoder.items() if i < 50255}, EOT: 50255}
    vocab_folder(tmp_path, drop_last_merge, lambda lines: lines[:-2] + [''])
    small = E.get_encoder('m', tmp_path)
    assert small is not enc and small.eot_token == 50255 and small.n_vocab == 50256
    assert enc.encode(' gazed') == [50255]
    assert small.encode(' gazed') == enc.encode(' g') + enc.encode('azed')  # merge 'Ġg azed'
    assert small.encode(EOT, 'all') == [50255]


def test_folder_without_files_uses_shipped_copy(tmp_path, enc):
    (tmp_path / 'empty').mkdir()
    assert E.get_encoder('empty', tmp_path) is enc
    assert E.get_encoder('absent', tmp_path) is enc


@pytest.mark.parametrize('present, missing', [('encoder.json', 'vocab.bpe'),
                                              ('vocab.bpe', 'encoder.json')])
def test_folder_with_one_file_is_an_error(tmp_path, present, missing):
    (tmp_path / 'm').mkdir()
    shutil.copy(f'{E.ASSETS_DIR}/{present}', tmp_path / 'm')
    message = f'{tmp_path / "m" / missing} is missing'
    with pytest.raises(E.VocabularyError, match=re.escape(message)):
        E.get_encoder('m', tmp_path)


def swap(i, j):
    def edit(lines):
        lines[i], lines[j] = lines[j], lines[i]
        return lines
    return edit


@pytest.mark.parametrize('edit_json, edit_bpe, named, message', [
    (lambda e: [1, 2], None, 'encoder.json', 'not a JSON object'),
    (lambda e: {**e, 'a': '1'}, None, 'encoder.json', 'not a JSON object'),
    (lambda e: {k: v for k, v in e.items() if k != EOT}, None, 'encoder.json', 'has no'),
    (lambda e: {**e, 'a': 3}, None, 'encoder.json', 'ids are not 0..50256, each once'),
    (lambda e: {**e, 'zzzzq': 50257}, None, 'encoder.json', 'has 50258 tokens but'),
    (lambda e: {**e, 'two words': 50257}, None, 'encoder.json', 'not in the byte alphabet'),
    (None, lambda lines: lines[:-11] + [''], 'vocab.bpe', 'has 49990 merges'),
    (None, swap(5, 6), 'vocab.bpe', 'line 6 of'),
    (None, lambda lines: lines[:3] + ['a b c'] + lines[4:], 'vocab.bpe',
     'line 4 is not two symbols'),
])
def test_corrupt_folder_is_an_error_naming_the_file(tmp_path, edit_json, edit_bpe, named, message):
    vocab_folder(tmp_path, edit_json, edit_bpe)
    with pytest.raises(E.VocabularyError, match=re.escape(message)) as error:
        E.get_encoder('m', tmp_path)
    assert str(tmp_path / 'm' / named) in str(error.value)


@pytest.mark.parametrize('name, data, message', [
    ('encoder.json', b'{"!": 0, ', 'not valid JSON'),
    ('vocab.bpe', b'#version: 0.2\n\xff\xfe\n', 'not valid UTF-8'),
])
def test_unreadable_file_is_an_error_naming_it(tmp_path, name, data, message):
    folder = vocab_folder(tmp_path)
    (folder / name).write_bytes(data)
    with pytest.raises(E.VocabularyError, match=re.escape(f'{folder / name}: {message}')):
        E.get_encoder('m', tmp_path)


def test_damaged_shipped_copy_is_an_error(tmp_path, monkeypatch):
    assets = tmp_path / 'assets'
    shutil.copytree(E.ASSETS_DIR, assets)
    data = (assets / 'vocab.bpe').read_bytes()
    (assets / 'vocab.bpe').chmod(0o644)
    (assets / 'vocab.bpe').write_bytes(data.replace(b'\xc4\xa0 t', b'\xc4\xa0 T', 1))
    monkeypatch.setattr(E, 'ASSETS_DIR', str(assets))
    for load in (E.default_encoder, lambda: E.get_encoder('absent', tmp_path)):
        with pytest.raises(E.VocabularyError, match=re.escape(f'{assets / "vocab.bpe"}: sha256')):
            load()


def test_shipped_digests_are_the_published_ones():
    readme = SHARED / 'README.md'
    if not readme.is_file():
        pytest.skip(f'{readme} not found (set TFGPT2_SHARED)')
    published = dict((name, digest) for digest, name in re.findall(
        r'^([0-9a-f]{64})\s+gpt2-vocab/(\S+)$', readme.read_text(), re.M))
    assert published == E.ASSETS_SHA256


def test_module_does_not_import_tensorflow():
    code = ('import importlib.util, sys\n'
            f'spec = importlib.util.spec_from_file_location("encoder", {E.__file__!r})\n'
            'module = importlib.util.module_from_spec(spec)\n'
            'spec.loader.exec_module(module)\n'
            'assert module.default_encoder().encode("Hi") == [17250]\n'
            'print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras")))')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '[]'
