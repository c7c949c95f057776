"""Hyperparameters: defaults as in the original, the published sizes, validation."""
import pytest

from tfgpt2.hparams import PUBLISHED, default_hparams, published_hparams


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
