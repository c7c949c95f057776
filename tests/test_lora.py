"""LoRA (`GPT2.enable_lora`, `tfgpt2 train --lora_rank`): Keras' convention for the adapters,
only they train, and the run folder holds the merged weights in OpenAI's layout (restored by
OpenAI's code) beside the adapters, from which a run continues exactly."""
import os

import numpy as np
import pytest
import keras

import tfgpt2
from tfgpt2.formats import lora
from tfgpt2.formats.checkpoint import save_checkpoint
from tfgpt2.hparams import default_hparams, load_hparams
from tfgpt2.model import GPT2
from tfgpt2.testing.reference import Reference
from tfgpt2.cli.train import parse_config
from tfgpt2.train.config import TrainConfig

from tests.helpers import TINY, ids_npz, random_ids, require_reference, run, run_interrupted, tensors


def tiny_model():
    """TINY's shape with 500 tokens, random weights of std 0.02 (the original's init)."""
    keras.utils.set_random_seed(0)
    return GPT2(default_hparams().override_from_dict({**TINY, "n_vocab": 500}))


def test_enable_lora_is_keras_dense_enable_lora():
    """Adapters a [nx, rank], b [rank, nf] (zeros: the model starts as the base), only they
    trainable, each layer's output x w + b + (alpha / rank) x a b."""
    model = tiny_model()
    x = np.random.default_rng(0).integers(0, 500, [2, 10])
    before = model(x)["logits"].numpy()
    model.enable_lora(3, ["c_attn", "mlp/c_proj"], lora_alpha=5)
    np.testing.assert_array_equal(model(x)["logits"].numpy(), before)
    n = TINY["n_embd"]
    shapes = {v.path: list(v.shape) for v in model.trainable_variables}
    assert shapes == {**{f"model/h{i}/attn/c_attn/lora_kernel_a": [n, 3] for i in range(2)},
                      **{f"model/h{i}/attn/c_attn/lora_kernel_b": [3, 3 * n] for i in range(2)},
                      **{f"model/h{i}/mlp/c_proj/lora_kernel_a": [4 * n, 3] for i in range(2)},
                      **{f"model/h{i}/mlp/c_proj/lora_kernel_b": [3, n] for i in range(2)}}
    conv = model.h[1].mlp.c_proj
    assert not conv.w.trainable and not model.wte.trainable and not conv.b.trainable
    conv.lora_kernel_b.assign(np.random.default_rng(1).normal(0, 0.3, [3, n]))
    h = np.random.default_rng(2).normal(0, 1, [2, 5, 4 * n]).astype(np.float32)
    w, a, b = conv.w.numpy()[0], conv.lora_kernel_a.numpy(), conv.lora_kernel_b.numpy()
    expected = h @ (w + 5 / 3 * a @ b) + conv.b.numpy()
    np.testing.assert_allclose(conv(h).numpy(), expected, atol=1e-4)
    assert np.abs(5 / 3 * h @ a @ b).max() > 0.1  # the adapter's share is not lost in the tolerance


def test_a_keras_file_keeps_the_adapters(tmp_path):
    """`model.save("x.keras")` of a model with adapters loads with them: the same targets,
    rank, alpha and trainable variables, and the same logits (no silent base model)."""
    model = tiny_model()
    model.enable_lora(2, ["c_attn", "c_fc"], lora_alpha=4)
    for v in model.trainable_variables:
        v.assign(np.random.default_rng(len(v.path)).normal(0, 0.3, v.shape))
    x = np.random.default_rng(0).integers(0, 500, [2, 7])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.lora == {"rank": 2, "alpha": 4.0, "targets": ["c_attn", "c_fc"]}
    assert [v.path for v in loaded.trainable_variables] == [v.path for v in model.trainable_variables]
    np.testing.assert_array_equal(loaded(x)["logits"].numpy(), model(x)["logits"].numpy())


def test_lora_targets_by_layer_name_and_bad_input_is_a_clear_error(tiny_dir, tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        model.enable_lora(0)
    with pytest.raises(ValueError, match=r"LoRA targets \['c_attention'\] name no Conv1D layer"):
        model.enable_lora(2, ["c_attn", "c_attention"])
    assert model.trainable_variables and not model.lora_targets  # nothing changed
    model.enable_lora(2, ["c_proj"])  # attention's and the MLP's
    adapted = sorted(name for name, conv in model.conv1d_layers() if conv.lora_enabled)
    assert adapted == ["h0/attn/c_proj", "h0/mlp/c_proj", "h1/attn/c_proj", "h1/mlp/c_proj"]
    with pytest.raises(ValueError, match="LoRA is already enabled on this model"):
        model.enable_lora(2)
    with pytest.raises(ValueError, match="LoRA is already enabled; it can be enabled once per layer"):
        model.h[0].attn.c_proj.enable_lora(2)
    default = tiny_model()
    default.enable_lora(1)
    assert sorted(name for name, conv in default.conv1d_layers() if conv.lora_enabled) == ["h0/attn/c_attn",
                                                                                          "h1/attn/c_attn"]
    with pytest.raises(SystemExit):
        parse_config(["--dataset", "x", "--lora_rank", "0"])
    with pytest.raises(ValueError, match="need --lora_rank"):
        TrainConfig(dataset="x", lora_targets=["c_fc"])
    with pytest.raises(ValueError, match=r"LoRA targets \['mlp/c_attn'\] name no Conv1D layer"):
        run(tiny_dir, tmp_path, "--dataset", ids_npz(tmp_path / "d.npz", random_ids(40)), "--lora_rank", "2",
            "--lora_targets", "c_fc", "mlp/c_attn")
    assert not (tmp_path / "checkpoint").exists()  # nothing written


@pytest.mark.slow  # XLA steps, OpenAI's code in a child process
def test_lora_run_folder_is_merged_in_openais_layout(tiny_dir, tmp_path):
    rank = 2
    history = run(tiny_dir, tmp_path, "--dataset", ids_npz(tmp_path / "d.npz", random_ids(200)), "--batch_size", "2",
                  "--steps", "3", "--learning_rate", "1e-2", "--lora_rank", str(rank), "--lora_alpha", "4",
                  "--lora_targets", "c_attn", "mlp/c_fc")
    assert len(history) == 3
    run_dir = tmp_path / "checkpoint" / "run1"
    base, merged = tensors(os.path.join(tiny_dir, "model.ckpt")), tensors(run_dir / "model-3")
    assert sorted(merged) == sorted(base)
    targeted = [f"model/h{i}/{part}/w" for i in range(2) for part in ("attn/c_attn", "mlp/c_fc")]
    for name in base:
        if name in targeted:
            # singular values past the rank-th are float32's rounding of the merged weights
            singular = np.linalg.svd((merged[name] - base[name])[0].astype(np.float64), compute_uv=False)
            assert singular[0] > 1e-2 and singular[rank] <= 1e-5 * singular[0], (name, singular[:rank + 2])
        else:
            np.testing.assert_array_equal(merged[name], base[name], err_msg=name)
    adapters = tensors(run_dir / "lora-3")
    assert lora.read_config(str(run_dir / "lora-3"))["rank"] == rank and adapters.pop("lora/config")
    assert sorted(adapters) == sorted(f"{t[:-2]}/lora_kernel_{k}" for t in targeted for k in "ab")
    # Adam's state exists for the adapters alone: two per adapter, and the step count
    optimizer = tensors(run_dir / "optimizer-3")
    assert sorted(v.size for v in optimizer.values()) == sorted([1] + [a.size for a in adapters.values()] * 2)

    tokens = random_ids(2 * 20, seed=6).reshape(2, 20)
    with Reference(require_reference(), str(run_dir)) as ref:
        theirs = ref.model(tokens)["logits"]
    merged_model = tfgpt2.load_model(str(run_dir))
    ours = merged_model(tokens)["logits"].numpy()
    adapted = tfgpt2.load_model(tiny_dir, lora=str(run_dir))
    assert adapted.lora_targets == ("c_attn", "mlp/c_fc") and len(adapted.trainable_variables) == 8
    unmerged = adapted(tokens)["logits"].numpy()
    assert np.abs(ours - theirs).max() <= 5e-4
    assert np.abs(unmerged - ours).max() <= 5e-4
    assert np.abs(tfgpt2.load_model(tiny_dir)(tokens)["logits"].numpy() - ours).max() > 1e-2  # it trained
    # generation's own products (on a CPU from 16 new tokens: a transposed copy of each weight)
    prompts = [[1, 2, 3], [4, 5]]
    expected = tfgpt2.generate(merged_model, prompts, 16, top_k=1)
    for row, want in zip(tfgpt2.generate(adapted, prompts, 16, top_k=1), expected):
        np.testing.assert_array_equal(row, want)

    with pytest.raises(FileNotFoundError, match="lora-7.index: no such file"):
        tfgpt2.load_model(tiny_dir, lora=str(run_dir / "lora-7"))
    with pytest.raises(ValueError, match="holds no 'lora/config': not a LoRA adapter checkpoint"):
        tfgpt2.load_model(tiny_dir, lora=str(run_dir / "model-3"))


@pytest.mark.slow
def test_a_lora_run_stopped_and_resumed_equals_an_uninterrupted_one(micro_dir, tmp_path, monkeypatch):
    common = ("--dataset", ids_npz(tmp_path / "d.npz", random_ids(300, seed=9)), "--batch_size", "2",
              "--accumulate_gradients", "2", "--learning_rate", "1e-2", "--save_every", "2", "--no_xla")
    lora_flags = (*common, "--steps", "5", "--lora_rank", "2", "--lora_targets", "c_attn", "c_fc")
    whole = run(micro_dir, tmp_path, *lora_flags, run_name="whole")
    first = run_interrupted(monkeypatch, 4, micro_dir, tmp_path, *lora_flags, run_name="resumed")
    assert [s for s, _ in first] == [1, 2, 3]
    second = run(micro_dir, tmp_path, *lora_flags, run_name="resumed")
    assert first + second == whole
    a, b = tmp_path / "checkpoint" / "whole", tmp_path / "checkpoint" / "resumed"
    for kind in ("model-5", "lora-5"):
        x, y = tensors(a / kind), tensors(b / kind)
        assert sorted(x) == sorted(y)
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=f"{kind}: {name}")
    assert not [n for n in os.listdir(b) if n.startswith(("lora-3.", "lora-2."))]  # went with their model

    with pytest.raises(ValueError, match=r"differ from the flags: --lora_rank 4 \(it has 2\)"):
        run(micro_dir, tmp_path, *lora_flags, "--lora_rank", "4", "--steps", "6", run_name="resumed")
    with pytest.raises(ValueError, match="was trained with LoRA"):
        run(micro_dir, tmp_path, *common, "--steps", "6", run_name="resumed")


@pytest.mark.slow
def test_a_tiny_model_memorizes_a_short_text_with_lora(tiny_dir, tmp_path):
    """With `wte` and `ln_f` frozen, the logits are the final norm's output against fixed random
    embeddings: the tiny model's own final norm (gains of std 0.3, random signs) keeps any
    token's lead small. Its gain set to 2 and bias to 0, as a
    trained model's final norm lets the hidden state point anywhere, adapters of rank 8
    memorize the text as full fine-tuning does."""
    weights = tensors(os.path.join(tiny_dir, "model.ckpt"))
    weights["model/ln_f/g"] = np.full_like(weights["model/ln_f/g"], 2)
    weights["model/ln_f/b"] = np.zeros_like(weights["model/ln_f/b"])
    model_dir = str(tmp_path / "models" / "tiny")
    save_checkpoint(weights, load_hparams(tiny_dir), model_dir)
    text = tmp_path / "poem.txt"
    text.write_text("Tyger Tyger, burning bright, In the forests of the night; "
                    "What immortal hand or eye, Could frame thy fearful symmetry?")
    history = run(model_dir, tmp_path, "--dataset", str(text), "--steps", "80", "--batch_size", "4",
                  "--learning_rate", "1e-2", "--no_xla", "--lora_rank", "8",
                  "--lora_targets", "c_attn", "c_proj", "c_fc")
    assert np.mean([loss for _, loss in history[-5:]]) < 0.5, history[-5:]


@pytest.mark.slow
def test_lora_with_remat_and_mixed_precision(micro_dir, tmp_path):
    """--remat gives the plain step's updates; --precision mixed_float16 (loss scaling, float32
    adapters) trains them too, and its run folder is float32 in OpenAI's layout. (Without XLA,
    which compiles slower; test_lora_run_folder_is_merged_in_openais_layout runs XLA's step.)"""
    common = ("--dataset", ids_npz(tmp_path / "d.npz", random_ids(200, seed=4)), "--batch_size", "2", "--no_xla",
              "--steps", "3", "--learning_rate", "1e-2", "--lora_rank", "2", "--lora_targets", "c_attn", "c_fc")
    plain = run(micro_dir, tmp_path, *common, run_name="plain")
    remat = run(micro_dir, tmp_path, *common, "--remat", run_name="remat")
    np.testing.assert_allclose([loss for _, loss in remat], [loss for _, loss in plain], rtol=1e-5)
    a, b = tensors(tmp_path / "checkpoint" / "plain" / "lora-3"), tensors(tmp_path / "checkpoint" / "remat" / "lora-3")
    for name in a:
        if name != lora.CONFIG:
            np.testing.assert_allclose(b[name], a[name], atol=1e-5, err_msg=name)

    mixed = run(micro_dir, tmp_path, *common, "--precision", "mixed_float16", "--remat", run_name="mixed")
    np.testing.assert_allclose([loss for _, loss in mixed], [loss for _, loss in plain], rtol=1e-2)
    merged, adapters = (tensors(tmp_path / "checkpoint" / "mixed" / name) for name in ("model-3", "lora-3"))
    assert {v.dtype for v in merged.values()} == {np.dtype("float32")}
    assert {v.dtype for name, v in adapters.items() if name != lora.CONFIG} == {np.dtype("float32")}
    step = np.abs(adapters["model/h0/mlp/c_fc/lora_kernel_b"]).max()
    assert step > 1e-3  # loss scaling skipped no more than it should
