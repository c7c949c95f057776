"""Conversions between OpenAI's layout, Hugging Face's (safetensors) and KerasHub presets."""
import importlib.util
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.helpers import TINY
from tfgpt2 import load_model
from tfgpt2.formats.hf_kerashub import ConversionError, convert, load, read, save, write
from tfgpt2.hparams import default_hparams
from tfgpt2.cli import convert as convert_cli
from tfgpt2.cli import generate as generate_cli
from tools.benchmark_train import has_modules, hf_python
from tfgpt2.testing.checkpoints import make_checkpoint

ATOL = 5e-4  # two correct fp32 implementations (tests/test_model.py)
TOKENS = np.random.default_rng(7).integers(0, 50257, size=(2, 17), dtype=np.int32)


@pytest.fixture(scope="module")
def std01_dir(tmp_path_factory):
    """Tiny hparams, weights of std 0.1 (the tolerance's premise)."""
    return make_checkpoint(str(tmp_path_factory.mktemp("models") / "tiny01"),
                           default_hparams().override_from_dict(TINY), std=0.1, seed=2)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("models") / "untied"),
                           default_hparams().override_from_dict(TINY), std=0.3, seed=4, tie_embeddings=False)


@pytest.fixture(scope="module")
def hf_dir(tiny_dir, tmp_path_factory):
    return convert(tiny_dir, str(tmp_path_factory.mktemp("hf") / "tiny"), src_format="openai", dst_format="hf")


def assert_same(a, b):
    (hp_a, tensors_a), (hp_b, tensors_b) = a, b
    assert hp_a == hp_b and sorted(tensors_a) == sorted(tensors_b)
    for name in tensors_a:
        assert tensors_b[name].dtype == np.float32
        np.testing.assert_array_equal(tensors_a[name], tensors_b[name], err_msg=name)


def assert_close(ours, theirs, what):
    diff = np.abs(np.asarray(ours) - np.asarray(theirs)).max()
    assert np.abs(theirs).max() > 3, "weights too small for a meaningful comparison"
    assert diff <= ATOL, f"{what}: max abs diff {diff:.3g} > {ATOL}"


def rewrite_safetensors(folder, change):
    """model.safetensors rewritten with `change(dict of arrays)` applied."""
    path = os.path.join(folder, "model.safetensors")
    with safe_open(path, "np") as f:
        arrays = {key: f.get_tensor(key) for key in f.keys()}
    change(arrays)
    save_file(arrays, path, metadata={"format": "pt"})


def edit_json(path, **changes):
    with open(path) as f:
        value = json.load(f)
    value.update(changes)
    with open(path, "w") as f:
        json.dump(value, f)


# OpenAI <-> Hugging Face

@pytest.mark.parametrize("model", ["tiny_dir", "untied_dir"])
def test_openai_hf_openai_is_bit_identical(model, request, tmp_path):
    src = request.getfixturevalue(model)
    convert(src, tmp_path / "hf", src_format="openai", dst_format="hf")
    convert(tmp_path / "hf", tmp_path / "back", src_format="hf", dst_format="openai")
    assert_same(read(src, "openai"), read(tmp_path / "back", "openai"))
    for name in ("encoder.json", "vocab.bpe"):
        with open(os.path.join(src, name), "rb") as a, open(tmp_path / "back" / name, "rb") as b:
            assert a.read() == b.read()
    untied = model == "untied_dir"
    back = load_model(tmp_path / "back", tie_embeddings=not untied)
    np.testing.assert_array_equal(back(TOKENS)["logits"].numpy(),
                                  load_model(src, tie_embeddings=not untied)(TOKENS)["logits"].numpy())


def test_hf_layout(hf_dir):
    """GPT2LMHeadModel's names, [nx, nf] without the leading 1, no lm_head when tied."""
    assert sorted(os.listdir(hf_dir)) == ["config.json", "merges.txt", "model.safetensors", "vocab.json"]
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_positions"], config["n_embd"], config["n_layer"], config["vocab_size"]) == (64, 64, 2, 50257)
    assert config["tie_word_embeddings"] is True and config["activation_function"] == "gelu_new"
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        assert f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape() == [64, 192]
        assert f.get_slice("transformer.h.1.mlp.c_proj.weight").get_shape() == [256, 64]
        assert f.get_slice("transformer.wpe.weight").get_shape() == [64, 64]
    assert len(keys) == 2 * 12 + 4 and "lm_head.weight" not in keys


def test_hf_reader_takes_unprefixed_names_and_ignores_mask_buffers(hf_dir, tmp_path):
    """As the hub's gpt2 folders have them: `h.0...` names, `attn.bias` and `attn.masked_bias`
    buffers, and an `lm_head.weight` copy of wte under tie_word_embeddings."""
    folder = shutil.copytree(hf_dir, tmp_path / "hub")

    def hub_style(arrays):
        for key in list(arrays):
            arrays[key.removeprefix("transformer.")] = arrays.pop(key)
        for layer in range(2):
            arrays[f"h.{layer}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
            arrays[f"h.{layer}.attn.masked_bias"] = np.array(-1e4, np.float32)
        arrays["lm_head.weight"] = arrays["wte.weight"]
    rewrite_safetensors(folder, hub_style)
    assert_same(read(folder, "hf"), read(hf_dir, "hf"))


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("transformer.h.1.mlp.c_fc.bias"), r"missing tensor h\.1\.mlp\.c_fc\.bias"),
    (lambda a: a.update({"transformer.h.0.attn.c_attn.weight": np.zeros((1, 64, 192), np.float32)}),
     r"h\.0\.attn\.c_attn\.weight is \[1, 64, 192\], config\.json implies \[64, 192\]"),
    (lambda a: a.update({"transformer.h.2.ln_1.weight": np.ones(64, np.float32)}),
     r"no place for: h\.2\.ln_1\.weight"),
    (lambda a: a.update({"transformer.wte.weight": np.zeros((50257, 64), np.int32)}),
     r"transformer\.wte\.weight: dtype int32"),
], ids=["missing", "misshapen", "extra", "integer"])
def test_hf_bad_tensors(hf_dir, tmp_path, change, message):
    folder = shutil.copytree(hf_dir, tmp_path / "bad")
    rewrite_safetensors(folder, change)
    with pytest.raises(ConversionError, match=message) as error:
        read(folder, "hf")
    assert "model.safetensors" in str(error.value)


@pytest.mark.parametrize("changes, message", [
    (dict(n_layer=3), r"missing tensor h\.2\.ln_1\.weight"),
    (dict(n_embd=128, n_head=4), r"wpe\.weight is \[64, 64\], config\.json implies \[64, 128\]"),
    (dict(n_positions=128), r"wpe\.weight is \[64, 64\], config\.json implies \[128, 64\]"),
    (dict(tie_word_embeddings=False), r"missing tensor lm_head\.weight"),
    (dict(model_type="llama"), r"model_type 'llama' is not GPT-2"),
    (dict(architectures=["GPT2ForSequenceClassification"]), "architecture 'GPT2ForSequenceClassification'"),
    (dict(activation_function="gelu"), r"activation_function='gelu' is not GPT-2's"),
    (dict(n_inner=100), r"n_inner=100 is not GPT-2's"),
    (dict(n_head=5), r"n_embd \(64\) must be divisible by hparams.n_head \(5\)"),
], ids=["layers", "width", "positions", "untied", "llama", "classifier", "gelu", "n_inner", "heads"])
def test_hf_config_that_disagrees_or_is_not_gpt2(hf_dir, tmp_path, changes, message):
    folder = shutil.copytree(hf_dir, tmp_path / "bad")
    edit_json(folder / "config.json", **changes)
    with pytest.raises(ConversionError, match=message) as error:
        read(folder, "hf")
    assert "config.json" in str(error.value)


def test_hf_pickle_is_never_read(hf_dir, tmp_path):
    folder = shutil.copytree(hf_dir, tmp_path / "pickled")
    os.rename(folder / "model.safetensors", folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is a pickle, which is never read"):
        read(folder, "hf")


def test_hf_sharded_index(hf_dir, tmp_path):
    """model.safetensors.index.json and its shards, as save_pretrained writes a large model."""
    folder = tmp_path / "sharded"
    os.makedirs(folder)
    shutil.copy(os.path.join(hf_dir, "config.json"), folder)
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "np") as f:
        keys = sorted(f.keys())
        shards = {f"model-0000{i + 1}-of-00002.safetensors": {k: f.get_tensor(k) for k in keys[i::2]}
                  for i in range(2)}
    for filename, arrays in shards.items():
        save_file(arrays, folder / filename, metadata={"format": "pt"})
    edit_json_path = folder / "model.safetensors.index.json"
    with open(edit_json_path, "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: name for name, a in shards.items() for k in a}}, f)
    assert_same(read(folder, "hf"), read(hf_dir, "hf"))


@pytest.mark.slow
def test_hf_transformers_gives_the_same_logits(std01_dir, tmp_path):
    """Optional: needs torch and transformers, in this interpreter or in the one
    TFGPT2_HF_PYTHON names. HF runs in a child process: torch and TensorFlow in one process
    can crash."""
    python = hf_python()
    if not has_modules(python, "torch", "transformers"):
        pytest.skip(f"torch or transformers is not installed for {python} (an optional test extra: "
                    "pip install transformers torch, or set TFGPT2_HF_PYTHON)")
    convert(std01_dir, tmp_path / "hf", src_format="openai", dst_format="hf")
    np.save(tmp_path / "tokens.npy", TOKENS)
    script = f"""
import numpy as np, torch, transformers
model = transformers.GPT2LMHeadModel.from_pretrained({str(tmp_path / "hf")!r}).eval()
with torch.no_grad():
    logits = model(torch.tensor(np.load({str(tmp_path / "tokens.npy")!r}), dtype=torch.long)).logits
np.save({str(tmp_path / "theirs.npy")!r}, logits.numpy())
"""
    child = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    assert_close(load_model(std01_dir)(TOKENS)["logits"].numpy(), np.load(tmp_path / "theirs.npy"),
                 "transformers logits")


# OpenAI <-> KerasHub

def test_openai_kerashub_openai_is_bit_identical(tiny_dir, tmp_path):
    convert(tiny_dir, tmp_path / "kh", src_format="openai", dst_format="kerashub")
    assert sorted(os.listdir(tmp_path / "kh")) == ["assets", "config.json", "metadata.json", "model.weights.h5",
                                                   "preprocessor.json", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path / "kh" / "assets" / "tokenizer")) == ["merges.txt", "vocabulary.json"]
    convert(tmp_path / "kh", tmp_path / "back", src_format="kerashub", dst_format="openai")
    assert_same(read(tiny_dir, "openai"), read(tmp_path / "back", "openai"))


@pytest.mark.slow
def test_kerashub_from_preset_gives_the_same_logits_and_its_own_presets_read_back(std01_dir, tmp_path):
    """Optional: needs keras-hub (pip install keras-hub)."""
    if importlib.util.find_spec("keras_hub") is None:
        pytest.skip("keras_hub is not installed (an optional test extra: pip install keras-hub)")
    import keras_hub
    convert(std01_dir, tmp_path / "kh", src_format="openai", dst_format="kerashub")
    lm = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "kh"))
    theirs = lm({"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}).numpy()
    assert_close(load_model(std01_dir)(TOKENS)["logits"].numpy(), theirs, "KerasHub logits")
    assert np.asarray(lm.preprocessor.tokenizer("Every effort moves you")).tolist() == [6109, 3626, 6100, 345]
    lm.save_to_preset(str(tmp_path / "saved"))  # KerasHub's own writer, read back by ours
    assert_same(read(tmp_path / "saved", "kerashub"), read(std01_dir, "openai"))


def test_kerashub_errors(tiny_dir, untied_dir, hf_dir, tmp_path):
    with pytest.raises(ConversionError, match="has no KerasHub preset"):
        convert(untied_dir, tmp_path / "untied", src_format="openai", dst_format="kerashub")
    assert not os.path.exists(tmp_path / "untied" / "config.json")
    with pytest.raises(ConversionError, match=r"None is not KerasHub's GPT2Backbone \(a Hugging Face folder"):
        read(hf_dir, "kerashub")
    folder = tmp_path / "kh"
    convert(tiny_dir, folder, src_format="openai", dst_format="kerashub")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "registered_name": "keras_hub>GemmaBackbone"}))
    with pytest.raises(ConversionError, match="'keras_hub>GemmaBackbone' is not KerasHub's GPT2Backbone"):
        read(folder, "kerashub")
    config["config"]["num_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="no place for: layers/transformer_decoder_1/"):
        read(folder, "kerashub")


# The library functions, the command line and model names

def test_load_and_save_models(tiny_dir, tmp_path):
    model = load_model(tiny_dir)
    for fmt in ("hf", "kerashub", "openai"):
        save(model, tmp_path / fmt, fmt)
        again = load(tmp_path / fmt, fmt)
        np.testing.assert_array_equal(again(TOKENS)["logits"].numpy(), model(TOKENS)["logits"].numpy())


def test_a_model_with_adapters_is_saved_merged(tiny_dir, tmp_path):
    """`save` writes LoRA adapters merged into `w` (as `save_model`), not refused or dropped."""
    model = load_model(tiny_dir)
    model.enable_lora(2, seed=0)
    for v in model.trainable_variables:
        v.assign(np.random.default_rng(len(v.path)).normal(0, 0.3, v.shape))
    save(model, tmp_path / "hf", "hf")
    expected, got = model(TOKENS)["logits"].numpy(), load(tmp_path / "hf", "hf")(TOKENS)["logits"].numpy()
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    assert np.abs(got - load_model(tiny_dir)(TOKENS)["logits"].numpy()).max() > 0.1  # the adapters count


def test_write_is_atomic(tiny_dir, tmp_path, monkeypatch):
    """A write that fails part way leaves no file under a final name."""
    hparams, tensors = read(tiny_dir, "openai")
    # the vocabulary is copied last, after the weights and config were written
    monkeypatch.setattr("tfgpt2.formats.hf_kerashub.shutil.copyfile", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write(hparams, tensors, tmp_path / "hf", "hf")
    assert os.listdir(tmp_path / "hf") == []


@pytest.mark.slow
def test_command_line(tiny_dir, tmp_path, capsys):
    models_dir, name = os.path.split(tiny_dir)
    assert convert_cli.main(["--from", "openai", "--to", "hf", "--models_dir", models_dir, name,
                             str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert_same(read(tmp_path / "hf", "hf"), read(tiny_dir, "openai"))
    with pytest.raises(SystemExit) as exit:
        convert_cli.main(["--from", "openai", "--to", "hf", "--models_dir", str(tmp_path), "355M", str(tmp_path / "x")])
    assert exit.value.code == 1
    assert "download it with `tfgpt2 download 355M" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        convert_cli.main(["--from", "hf", "--to", "openai", str(tmp_path / "nowhere"), str(tmp_path / "y")])
    assert exit.value.code == 1 and "nowhere: no such folder" in capsys.readouterr().err


@pytest.mark.slow
def test_model_names_resolve_models_dir_and_say_how_to_download(tiny_dir, tmp_path, monkeypatch):
    models_dir, name = os.path.split(tiny_dir)
    assert load_model(name, models_dir=models_dir).hparams.n_layer == 2
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"models/124M: no such model folder; download it with "
                                                r"`tfgpt2 download 124M`"):
        load_model("124M")
    monkeypatch.setattr(generate_cli, "end_at_once", lambda: None)  # leaves this process's signals alone
    with pytest.raises(SystemExit) as exit:
        generate_cli.main(["--model_name", "355M", "--models_dir", "elsewhere"])
    assert exit.value.code == ("error: elsewhere/355M: no such model folder; download it with "
                               "`tfgpt2 download 355M --models_dir elsewhere` (offline, `tfgpt2 make-checkpoint "
                               "355M --models_dir elsewhere` writes random weights in the same layout)")


def test_load_model_on_a_hugging_face_folder_points_to_convert(tiny_dir, hf_dir, tmp_path):
    """`tfgpt2.load_model` (and every command) on config.json + model.safetensors: the way to
    read it, not just `hparams.json: no such file`; the way works."""
    message = (rf"hparams.json: no such file; \S+ looks like a Hugging Face folder \(config.json\): convert it with "
               rf"`tfgpt2 convert --from hf --to openai \S+ DST` \(in Python: tfgpt2.formats.hf_kerashub.load\('\S+', "
               r"'hf'\)\)")
    with pytest.raises(FileNotFoundError, match=message):
        load_model(hf_dir)
    assert convert_cli.main(["--from", "hf", "--to", "openai", hf_dir, str(tmp_path / "dst"), "--quiet"]) == 0
    expected = load_model(tiny_dir)(TOKENS)["logits"].numpy()
    np.testing.assert_array_equal(load_model(str(tmp_path / "dst"))(TOKENS)["logits"].numpy(), expected)
    np.testing.assert_array_equal(load(hf_dir, "hf")(TOKENS)["logits"].numpy(), expected)


def test_the_command_writes_over_nothing_unless_asked(tiny_dir, tmp_path, capsys):
    """DST with files in it: refused (unchanged) without --overwrite; a run folder is refused
    even with it (it rewrote `checkpoint`, so the next `train` resumed from these weights)."""
    def run(dst, *more):
        with pytest.raises(SystemExit) as exit:
            convert_cli.main(["--from", "openai", "--to", "openai", tiny_dir, str(dst), *more])
        assert exit.value.code == 1
        return capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert "mine is a folder with files in it; choose another, or pass --overwrite" in run(mine)
    run_dir = tmp_path / "checkpoint" / "run1"
    run_dir.mkdir(parents=True)
    files = {"checkpoint": 'model_checkpoint_path: "model-3"\n', "counter": "3\n"}
    for name, text in files.items():
        (run_dir / name).write_text(text)
    for more in ([], ["--overwrite"]):
        assert "run1 is a training run folder" in run(run_dir, *more)
    assert {p.name: p.read_text() for p in run_dir.iterdir()} == files
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert convert_cli.main(["--from", "openai", "--to", "hf", tiny_dir, str(mine), "--overwrite", "--quiet"]) == 0
    assert (mine / "notes.txt").read_text() == "keep" and (mine / "config.json").is_file()
