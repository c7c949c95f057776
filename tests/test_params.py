"""Parameter counts: tied and untied, from hparams, from a built model, and from the CLI."""
import json

import pytest

from tests.helpers import TINY, in_child
from tfgpt2 import GPT2, count_params
from tfgpt2.hparams import default_hparams, published_hparams
from tfgpt2.formats.variables import breakdown
from tfgpt2.cli import params as params_cli

EXPECTED = {  # tied, untied
    "124M": (124_439_808, 163_037_184),
    "355M": (354_823_168, 406_286_336),
    "774M": (774_030_080, 838_359_040),
    "1558M": (1_557_611_200, 1_638_022_400),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_breakdown_totals(name):
    rows = dict(breakdown(published_hparams(name)))
    assert (rows["total, tied"], rows["total, untied"]) == EXPECTED[name]
    assert rows["output layer, tied to wte"] == 0
    assert rows["output layer, untied"] == 50257 * published_hparams(name).n_embd


@pytest.mark.slow
def test_built_124m_model_counts_shared_variable_once():
    assert in_child(built_counts, "124M") == (124_439_808, 163_037_184)  # two 124M models: a process of its own


def built_counts(name):
    hp = published_hparams(name)
    return count_params(GPT2(hp)), count_params(GPT2(hp, tie_embeddings=False))


def test_cli_prints_breakdown(tiny_dir, capsys):
    """`tfgpt2 params` (`python -m tfgpt2 params` runs the same `main`)."""
    assert params_cli.main(["--model_name", "124M"]) == 0
    out = capsys.readouterr().out
    assert "38,597,376" in out and "124,439,808" in out and "163,037,184" in out
    assert "85,054,464" in out  # 12 blocks of 7,087,872
    assert params_cli.main(["--model_dir", tiny_dir]) == 0
    out = capsys.readouterr().out
    tiny = dict(breakdown(default_hparams().override_from_dict(TINY)))
    assert f"{tiny['total, tied']:,}" in out


def test_hugging_faces_names_are_the_published_sizes(tmp_path, capsys):
    """gpt2, gpt2-medium, gpt2-large, gpt2-xl: 124M, 355M, 774M, 1558M, as MODEL, --model_name,
    and a folder name in --models_dir."""
    for alias, name in [("gpt2", "124M"), ("gpt2-medium", "355M"), ("gpt2-large", "774M"), ("gpt2-xl", "1558M")]:
        outs = []
        for argv in ([alias], ["--model_name", alias], [name]):
            assert params_cli.main(argv) == 0
            outs.append(capsys.readouterr().out)
        assert outs[0] == outs[1] == outs[2]
    (tmp_path / "355M").mkdir()
    (tmp_path / "355M" / "hparams.json").write_text(json.dumps(dict(TINY)))
    assert params_cli.main(["--model_name", "gpt2-medium", "--models_dir", str(tmp_path)]) == 0
    assert f"hparams: {TINY}" in capsys.readouterr().out
