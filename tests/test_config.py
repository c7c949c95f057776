"""`TrainConfig` (tfgpt2/train/config.py): one typed value for a run's settings, made from the
flags (`tfgpt2 train`, `python -m tfgpt2.train`) or from `tfgpt2.finetune`'s keywords, each
setting's range checked there once, with the same message either way."""
import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tfgpt2.cli.train import parse_config, training_parser
from tfgpt2.train.config import TrainConfig

# The forks' train.py flags (and gpt-2-simple's), which `tfgpt2 train` and `finetune` keep.
FORKS = {"dataset", "model_name", "models_dir", "combine", "encoding", "batch_size", "learning_rate", "optimizer",
         "accumulate_gradients", "only_train_transformer_layers", "run_name", "restore_from", "sample_every",
         "sample_length", "sample_num", "save_every", "val_dataset", "val_batch_size", "val_batch_count",
         "val_every", "top_k", "top_p", "noise"}


def test_the_flags_are_the_configs_settings_with_its_defaults():
    """A flag per setting, none more; flags left out give the dataclass's defaults, which are the forks'."""
    flags = {a.dest for a in training_parser()._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(TrainConfig)} and FORKS <= flags
    config = parse_config(["--dataset", "corpus.txt"])
    assert config == TrainConfig(dataset="corpus.txt")
    assert (config.learning_rate, config.batch_size, config.optimizer, config.combine, config.top_k,
            config.sample_length, config.steps, config.remat) == (2e-5, 1, "adam", 50000, 40, None, -1, False)


def test_flags_and_keywords_make_the_same_config():
    argv = ["--dataset", "d.npz", "--steps", "10", "--learning_rate", "1e-3", "--remat", "--lora_rank", "4",
            "--lora_targets", "c_attn", "c_fc", "--val_fraction", "0.25", "--checkpoint_dir", "runs"]
    keywords = dict(dataset=Path("d.npz"), steps=np.int64(10), learning_rate=1e-3, remat=True, lora_rank=4,
                    lora_targets=["c_attn", "c_fc"], val_fraction=0.25, checkpoint_dir=Path("runs"))
    config = parse_config(argv)
    assert config == TrainConfig.of(**keywords)
    assert config.lora_targets == ("c_attn", "c_fc") and config.run_dir == str(Path("runs") / "run1")
    assert TrainConfig.of(dataset="d", lora_rank=2, lora_targets="c_fc").lora_targets == ("c_fc",)
    assert TrainConfig.of(dataset="d", remat=None, tpu=None).remat is False  # a keyword of None: not given


@pytest.mark.parametrize("name, value, message", [
    ("batch_size", 0, "--batch_size must be an integer >= 1, got 0"),
    ("steps", -2, "--steps must be an integer >= -1, got -2"),
    ("steps", 2.5, "--steps must be an integer >= -1, got 2.5"),
    ("steps", True, "--steps must be an integer >= -1, got True"),
    ("val_fraction", 1.5, "--val_fraction must be a number in [0, 1], got 1.5"),
    ("learning_rate", math.nan, "--learning_rate must be a finite number >= 0, got nan"),
    ("learning_rate", "fast", "--learning_rate must be a finite number >= 0, got 'fast'"),
    ("lora_rank", 0, "--lora_rank must be an integer >= 1, got 0"),
    ("optimizer", "adagrad", "--optimizer must be one of adam, adamw, sgd, adafactor, got 'adagrad'"),
    ("remat", 1, "--remat must be True or False, got 1"),
    ("lora_targets", [], "--lora_targets must be one or more names, got []"),
    ("model_name", 124, "--model_name must be a string, got 124"),
    ("noise", 1.5, "--noise must be a number in [0, 1], got 1.5"),
    ("top_p", -0.1, "--top_p must be a number in [0, 1], got -0.1"),
    ("seed", -500, "--seed must be an integer in [0, 2**63), got -500"),
    ("seed", 2**63, "--seed must be an integer in [0, 2**63), got 9223372036854775808"),
    ("max_bad_steps", -1, "--max_bad_steps must be an integer >= 0, got -1"),
    ("encoding", "nope-8", "--encoding: unknown text encoding 'nope-8'"),
])
def test_a_value_out_of_range_names_its_flag(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig.of(dataset="d", **{name: value})


def test_the_command_reports_the_configs_error_as_a_usage_line(capsys):
    """The flags give text; the config reads and checks it, and the command prints its message."""
    for argv, message in [(["--batch_size", "0"], "--batch_size must be an integer >= 1, got '0'"),
                          (["--steps", "1.5"], "--steps must be an integer >= -1, got '1.5'"),
                          (["--lr_schedule", "cosine"], "--lr_schedule cosine needs --steps"),
                          (["--lora_alpha", "2"], "--lora_alpha and --lora_targets need --lora_rank")]:
        with pytest.raises(SystemExit) as e:
            parse_config(["--dataset", "d", *argv], prog="tfgpt2 train")
        assert e.value.code == 2
        assert capsys.readouterr().err == f"tfgpt2 train: error: {message} (see --help)\n"


def test_the_forks_names_and_flags():
    """nshepperd's --memory_saving_gradients (gpt-2-simple's use_memory_saving_gradients) is
    --remat; --noise and --top_p are the forks' settings, taken as they are."""
    assert parse_config(["--dataset", "d", "--memory_saving_gradients"]) == TrainConfig(dataset="d", remat=True)
    assert TrainConfig.of(dataset="d", use_memory_saving_gradients=True).remat is True
    config = parse_config(["--dataset", "d", "--noise", "0.1", "--top_p", "0.9", "--max_bad_steps", "2"])
    assert (config.noise, config.top_p, config.max_bad_steps) == (0.1, 0.9, 2)
    assert (config.model_name, config.base_model) == (None, "124M")  # a run continues from its own model


def test_rules_across_settings_and_unknown_ones():
    with pytest.raises(ValueError, match="--lr_schedule cosine needs --steps"):
        TrainConfig(dataset="d", lr_schedule="cosine")
    assert TrainConfig(dataset="d", lr_schedule="cosine", steps=5).lr_schedule == "cosine"
    with pytest.raises(ValueError, match="--lora_alpha and --lora_targets need --lora_rank"):
        TrainConfig(dataset="d", lora_targets=["c_fc"])
    with pytest.raises(ValueError, match=re.escape("unknown setting 'optimiser' (did you mean 'optimizer'?)")):
        TrainConfig.of(dataset="d", optimiser="adam")
    with pytest.raises(ValueError, match="--dataset must be a string, got None"):
        TrainConfig.of(dataset=None)


def test_the_config_is_made_once_and_not_changed():
    """Frozen: the loop takes a copy with the default window filled in, the caller's stays."""
    config = TrainConfig(dataset="d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sample_length = 10
    assert config.window(1024) == 1023 and config.sample_length is None
    assert TrainConfig(dataset="d", sample_length=64).window(64) == 64
    with pytest.raises(ValueError, match="--sample_length 65 exceeds the model's context n_ctx=64"):
        TrainConfig(dataset="d", sample_length=65).window(64)
