"""Hyperparameters: defaults as in the original, the published sizes, validation."""
import json

import pytest

from tfgpt2.hparams import FIELDS, PUBLISHED, default_hparams, load_hparams, published_hparams


def test_default_is_124m_shape_with_vocab_unset():
    assert default_hparams().values() == dict(n_vocab=0, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)


def test_published_sizes():
    assert set(PUBLISHED) == {"124M", "355M", "774M", "1558M"}
    assert published_hparams("1558M").n_head == 25
    with pytest.raises(ValueError, match="unknown model name '117B'"):
        published_hparams("117B")


@pytest.mark.parametrize("values, message", [
    ({"n_embd": 100}, r"n_embd \(100\) must be divisible by hparams.n_head \(12\)"),
    ({"n_layer": 0}, r"hparams.n_layer must be >= 1, got 0"),
    ({"n_vocab": -1}, r"hparams.n_vocab must be >= 0, got -1"),
    ({"n_head": 2.5}, r"hparams.n_head must be an integer, got 2.5"),
    ({"n_ctx": True}, r"hparams.n_ctx must be an integer, got True"),
    ({"n_heads": 4}, r"unknown hparams \['n_heads'\]"),
])
def test_validation_names_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        default_hparams().override_from_dict(values)


def write(folder, values):
    folder.mkdir(exist_ok=True)
    (folder / "hparams.json").write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("key", FIELDS)
def test_hparams_json_must_set_every_field(tmp_path, key):
    """OpenAI's hparams.json sets all five; a missing one is named, not filled with 124M's."""
    values = dict(PUBLISHED["124M"])
    del values[key]
    with pytest.raises(ValueError, match=rf"hparams\.json: missing {key}; a GPT-2 hparams\.json sets all of "
                                         r"n_vocab, n_ctx, n_embd, n_head, n_layer$"):
        load_hparams(write(tmp_path, values))


def test_hparams_json_names_a_misspelt_field(tmp_path):
    values = dict(PUBLISHED["124M"], n_embed=768)
    del values["n_embd"]
    with pytest.raises(ValueError, match=r"missing n_embd \(but unknown \['n_embed'\]\)"):
        load_hparams(write(tmp_path, values))
    assert load_hparams(write(tmp_path, PUBLISHED["124M"])).values() == PUBLISHED["124M"]
