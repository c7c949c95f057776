"""GPT2 the Keras way: config, `.keras` files, `.weights.h5`, summary()."""
import io
import json
import subprocess
import sys
from contextlib import redirect_stdout

import keras
import numpy as np
import pytest

from tests.helpers import ROOT
from tfgpt2 import GPT2, load_model
from tfgpt2.hparams import default_hparams
from tfgpt2.model import MLP, Attention, Block, Conv1D, Norm
from tfgpt2.formats.variables import breakdown

pytestmark = pytest.mark.slow  # Keras files loaded in fresh processes

HP = dict(n_vocab=100, n_ctx=16, n_embd=32, n_head=4, n_layer=2)
TOKENS = np.array([[5, 17, 99, 0, 42], [1, 2, 3, 4, 5]], dtype=np.int32)


def untied(model_dir):
    """The tiny model with an output layer of its own, different from wte."""
    model = load_model(model_dir, tie_embeddings=False)
    model.out_head.assign(np.random.default_rng(3).standard_normal(model.out_head.shape).astype("float32") * 0.3)
    return model


def test_config_carries_hparams_tie_and_dtype_policy():
    hp = default_hparams().override_from_dict(HP)
    model = GPT2(hp, tie_embeddings=False, dtype="float16")
    config = json.loads(json.dumps(model.get_config()))  # plain JSON
    assert config["hparams"] == HP and config["tie_embeddings"] is False
    again = GPT2.from_config(config)
    assert again.hparams == hp and again.tie_embeddings is False and again.out_head is not None
    assert again.dtype_policy.name == "float16"


@pytest.mark.parametrize("layer", [
    Norm(32, epsilon=1e-6, name="ln"), Conv1D(32, 96, w_init_stdev=0.1, name="c"), MLP(32, 128, name="mlp"),
    Attention(32, hparams=default_hparams().override_from_dict(HP), name="attn"),
    Block(hparams=default_hparams().override_from_dict(HP), name="h0")], ids=lambda layer: layer.name)
def test_layers_are_registered_and_round_trip_their_config(layer):
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == f"tfgpt2>{type(layer).__name__}"
    again = keras.saving.deserialize_keras_object(json.loads(json.dumps(serialized)))
    assert type(again) is type(layer) and again.get_config() == layer.get_config()


def test_keras_file_round_trip_in_a_fresh_process(tiny_dir, tmp_path):
    """model.save('x.keras'), then keras.models.load_model in another process: identical
    logits, tied and untied, and the untied head is the saved one, not wte."""
    models = {"tied": load_model(tiny_dir), "untied": untied(tiny_dir)}
    for name, model in models.items():
        model.save(tmp_path / f"{name}.keras")
    np.save(tmp_path / "tokens.npy", TOKENS)
    script = f"""
import numpy as np, keras
import tfgpt2.model  # registers GPT2 and its layers with Keras
tokens = np.load({str(tmp_path / 'tokens.npy')!r})
for name in ("tied", "untied"):
    model = keras.models.load_model({str(tmp_path)!r} + f"/{{name}}.keras")
    assert isinstance(model, tfgpt2.model.GPT2) and model.tie_embeddings == (name == "tied")
    np.save({str(tmp_path)!r} + f"/{{name}}-logits.npy", model(tokens)["logits"].numpy())
    if name == "untied":
        np.save({str(tmp_path)!r} + "/out_head.npy", model.out_head.numpy())
"""
    child = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    for name, model in models.items():
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}-logits.npy"), model(TOKENS)["logits"].numpy())
    head = np.load(tmp_path / "out_head.npy")
    np.testing.assert_array_equal(head, models["untied"].out_head.numpy())
    assert not np.array_equal(head, models["untied"].wte.numpy())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_weights_h5_round_trip(tiny_dir, tmp_path, tie):
    model = load_model(tiny_dir) if tie else untied(tiny_dir)
    model.save_weights(tmp_path / "m.weights.h5")
    fresh = GPT2(model.hparams, tie_embeddings=tie)
    assert not np.array_equal(fresh.wte.numpy(), model.wte.numpy())
    fresh.load_weights(tmp_path / "m.weights.h5")
    for ours, theirs in zip(fresh.weights, model.weights):
        assert ours.path == theirs.path
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    np.testing.assert_array_equal(fresh(TOKENS)["logits"].numpy(), model(TOKENS)["logits"].numpy())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_summary_shows_shapes_and_counts_tied_wte_once(tie, monkeypatch):
    hp = default_hparams().override_from_dict(HP)
    model = GPT2(hp, tie_embeddings=tie)
    monkeypatch.setenv("COLUMNS", "160")  # rich's console width off a terminal
    text = io.StringIO()
    with redirect_stdout(text):
        model.summary(line_length=160)
    text = text.getvalue()
    assert "?" not in text, text
    assert "(None, None, 32)" in text and "(None, 2, 4, None, 8)" in text, text  # block: x and present
    totals = dict(breakdown(hp))
    assert f"Total params: {totals['total, tied' if tie else 'total, untied']:,} " in text, text
