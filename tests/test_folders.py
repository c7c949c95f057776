"""Model folders and their vocabulary (tfgpt2/formats/folders.py, with encoder.vocabulary_files'
rule): found one way by the library, every command and training; a folder with only one of
encoder.json and vocab.bpe is the same error everywhere, one with neither the shipped copy."""
import json
import os
import re
import shutil

import pytest

from tfgpt2 import encoder as E
from tfgpt2.cli import params as params_cli
from tfgpt2.formats import folders, hf_kerashub
from tfgpt2.formats.checkpoint import load_model
from tfgpt2.hparams import load_hparams
from tfgpt2.train.config import TrainConfig
from tfgpt2.train.loop import train


def model_copy(tiny_dir, folder, *, keep=E.VOCAB_FILES):
    """A copy of the tiny model folder holding only the vocabulary files `keep`."""
    shutil.copytree(tiny_dir, folder, ignore=lambda _, names: [n for n in names if n in set(E.VOCAB_FILES) - set(keep)])
    return str(folder)


@pytest.mark.parametrize("missing", E.VOCAB_FILES)
def test_half_a_vocabulary_is_the_same_error_everywhere(tiny_dir, tmp_path, missing):
    """The encoder, the commands' `encoder_of`, a run folder's vocabulary, `tfgpt2 convert` and
    training each name the missing file, and training writes nothing."""
    (present,) = set(E.VOCAB_FILES) - {missing}
    half = model_copy(tiny_dir, tmp_path / "half", keep=[present])
    message = re.escape(f"{os.path.join(half, missing)} is missing: a model folder needs both encoder.json and "
                        "vocab.bpe, or neither to use the shipped copy")
    calls = [lambda: E.get_encoder("half", str(tmp_path)), lambda: folders.encoder_of(half),
             lambda: folders.vocabulary_source(half, tiny_dir),
             lambda: hf_kerashub.convert(half, str(tmp_path / "hf"), src_format="openai", dst_format="hf"),
             lambda: train(TrainConfig(dataset=str(tmp_path / "d.txt"), models_dir=str(tmp_path), model_name="half",
                                       checkpoint_dir=str(tmp_path / "checkpoint")))]
    for call in calls:
        with pytest.raises(E.VocabularyError, match=message):
            call()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "checkpoint").exists()


def test_a_folder_with_neither_file_gives_the_shipped_copy(tiny_dir, tmp_path):
    bare = model_copy(tiny_dir, tmp_path / "bare", keep=())
    shipped = E.default_encoder()
    assert E.vocabulary_files(bare) is None and E.vocabulary_files(str(tmp_path / "absent")) is None
    assert folders.encoder_of(bare) is shipped and E.get_encoder("bare", str(tmp_path)) is shipped
    assert folders.vocabulary_source(bare, str(tmp_path / "absent")) == E.ASSETS_DIR
    assert folders.vocabulary_source(bare, tiny_dir) == tiny_dir  # the first folder that has one
    assert E.vocabulary_files(tiny_dir) == [os.path.join(tiny_dir, name) for name in E.VOCAB_FILES]


def test_a_model_is_a_folder_or_a_name_in_the_models_folder(tiny_dir, tmp_path, monkeypatch):
    models, name = os.path.split(tiny_dir)
    assert folders.model_folder(name, models) == tiny_dir == folders.model_folder("x", "y", model_dir=tiny_dir)
    assert folders.find_model_dir(name, models) == tiny_dir == folders.find_model_dir(tiny_dir)
    monkeypatch.setenv("HOME", models)
    assert folders.model_folder(name, "~") == tiny_dir and folders.model_path("124M", "~") == f"{models}/124M"
    assert load_model(name, models_dir=models).hparams == load_hparams(tiny_dir)


def test_hugging_faces_names_are_the_published_folders(tiny_dir, tmp_path, monkeypatch):
    """gpt2 / gpt2-medium name models/124M / models/355M wherever a model name is taken (a
    folder of that name, where there is one, comes first); a missing one says how to download it."""
    os.symlink(tiny_dir, tmp_path / "355M")
    assert folders.model_folder("gpt2-medium", str(tmp_path)) == str(tmp_path / "355M")
    assert folders.find_model_dir(str(tmp_path / "gpt2-medium")) == str(tmp_path / "355M")
    from tfgpt2.train.run_folder import find_start
    config = TrainConfig(dataset="-", model_name="gpt2-medium", models_dir=str(tmp_path),
                         checkpoint_dir=str(tmp_path / "checkpoint"))
    assert find_start(config)[1] == str(tmp_path / "355M")  # `tfgpt2 train --model_name gpt2-medium`
    os.symlink(tiny_dir, tmp_path / "gpt2-medium")
    assert folders.model_folder("gpt2-medium", str(tmp_path)) == str(tmp_path / "gpt2-medium")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape("models/124M: no such model folder; download it with "
                                                          "`tfgpt2 download 124M`")):
        folders.model_folder("gpt2", "models")


@pytest.mark.parametrize("model, models_dir, argv, message", [
    ("124M", "models", ["--model_name", "124M", "--models_dir", "models"],
     "models/124M: no such model folder; download it with `tfgpt2 download 124M` (offline, "
     "`tfgpt2 make-checkpoint 124M` writes random weights in the same layout)"),
    ("355M", "elsewhere", ["--model_name", "355M", "--models_dir", "elsewhere"],
     "elsewhere/355M: no such model folder; download it with `tfgpt2 download 355M --models_dir elsewhere` "
     "(offline, `tfgpt2 make-checkpoint 355M --models_dir elsewhere` writes random weights in the same layout)"),
    ("mine", "models", ["--model_dir", "models/mine"],
     "models/mine: no such model folder (the published models are 124M, 355M, 774M, 1558M)"),
])
def test_a_missing_model_says_how_to_get_it(tmp_path, monkeypatch, capsys, model, models_dir, argv, message):
    """The same message from the library, a model name, and a command (`tfgpt2 params`)."""
    monkeypatch.chdir(tmp_path)
    for call in (lambda: folders.model_folder(model, models_dir), lambda: load_model(model, models_dir=models_dir)):
        with pytest.raises(FileNotFoundError, match=re.escape(message)):
            call()
    with pytest.raises(SystemExit):
        params_cli.main(argv)
    assert message in capsys.readouterr().err


def test_hparams_json_is_written_as_openai_writes_it(tiny_dir, tmp_path):
    hparams = load_hparams(tiny_dir)
    folders.save_hparams(hparams, tmp_path)
    text = (tmp_path / "hparams.json").read_text()
    assert text == hparams.to_json() and json.loads(text) == hparams.values()
    assert load_hparams(str(tmp_path)) == hparams
