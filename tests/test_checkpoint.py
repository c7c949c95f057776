"""Loading and saving OpenAI's checkpoint layout, and the errors for bad folders."""
import ctypes
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import ATOL, TINY, require_reference
from tfgpt2 import CheckpointError, load_model, save_model
from tfgpt2.formats import bundle
from tfgpt2.formats.checkpoint import save_checkpoint
from tfgpt2.hparams import default_hparams, load_hparams
from tfgpt2.testing.reference import Reference
from tfgpt2.testing.checkpoints import make_checkpoint, random_weights


@pytest.fixture
def folder(tiny_dir, tmp_path):
    """A private copy of the tiny model folder that a test may damage."""
    return shutil.copytree(tiny_dir, tmp_path / "tiny")


def stored(model_dir):
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "model.ckpt"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def test_load_reads_every_variable(tiny_dir):
    model = load_model(tiny_dir)
    values = stored(tiny_dir)
    assert {v.path for v in model.weights} == set(values)
    for v in model.weights:
        np.testing.assert_array_equal(v.numpy(), values[v.path], err_msg=v.path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_variables_are_read_without_a_copy(tiny_dir, dtype):
    """The loader writes with a scatter, which leaves a variable copy-on-read: every later
    read, in each generate or train step without XLA, would copy the whole weight."""
    def buffer(tensor):
        """The address of the tensor's memory on its device, CPU or GPU: DLPack's data pointer
        (the first field of the DLTensor its capsule holds)."""
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        return ctypes.c_void_p.from_address(get(tf.experimental.dlpack.to_dlpack(tensor), b"dltensor")).value
    model = load_model(tiny_dir, dtype=dtype)
    for v in model.weights:
        first, second = v.value.read_value(), v.value.read_value()  # both alive: no reuse
        assert buffer(first) == buffer(second), v.path


def test_load_from_prefix_and_folder(tiny_dir):
    a = load_model(tiny_dir, checkpoint=os.path.join(tiny_dir, "model.ckpt"))
    b = load_model(tiny_dir)
    np.testing.assert_array_equal(a.wte.numpy(), b.wte.numpy())


def test_index_reader_agrees_with_tensorflows(tiny_dir):
    prefix = os.path.join(tiny_dir, "model.ckpt")
    header, entries = bundle.read_index(prefix)
    reader = tf.train.load_checkpoint(prefix)
    assert header.num_shards == 1
    assert {name: [d.size for d in e.shape.dim] for name, e in entries.items()} == reader.get_variable_to_shape_map()
    assert {name: tf.as_dtype(e.dtype) for name, e in entries.items()} == reader.get_variable_to_dtype_map()


@pytest.mark.parametrize("block_bytes", [1, 1000, 1 << 30])
def test_row_blocks_cover_each_tensor_once(tiny_dir, monkeypatch, block_bytes):
    """Blocks of one row along the first axis longer than 1 ([1, nx, nf] by rows of nf),
    of several rows, and whole."""
    monkeypatch.setattr(bundle, "BLOCK_BYTES", block_bytes)
    prefix = os.path.join(tiny_dir, "model.ckpt")
    header, entries = bundle.read_index(prefix)
    values = stored(tiny_dir)
    for name, entry in entries.items():
        whole, count = np.full(values[name].shape, np.nan, np.float32), np.zeros(values[name].shape, int)
        for indices, rows in bundle.row_blocks(prefix, header, entry):
            where = tuple(indices.T)
            whole[where] = rows
            count[where] += 1
        np.testing.assert_array_equal(count, 1, err_msg=name)
        np.testing.assert_array_equal(whole, values[name], err_msg=name)


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """The tiny model with 300 tokens: a row-at-a-time load of wte in 300 blocks, not 50,257."""
    return make_checkpoint(str(tmp_path_factory.mktemp("models") / "small"),
                           default_hparams().override_from_dict(dict(TINY, n_vocab=300)), std=0.3, seed=5)


def test_a_load_holds_one_block_of_rows_at_a_time(small_vocab_dir, monkeypatch):
    """Each variable written a block of rows at a time (here a row: blocks of 1000 bytes), in
    float32 and cast to bfloat16: each block read, cast to the variable's dtype and written into
    it in place, every element once, and no tensor ever read whole (TensorFlow's RestoreV2
    returns one, and its allocator keeps the buffer: a float32 `wte` beside a bfloat16 model).
    So a load holds the model and one block; the peak that makes on a machine is a figure of
    `tools/benchmark_memory.py`."""
    values = stored(small_vocab_dir)
    monkeypatch.setattr(bundle, "BLOCK_BYTES", 1000)
    read, written = [], []
    row_blocks, scatter = bundle.row_blocks, tf.raw_ops.ResourceScatterNdUpdate

    def reading(*args):
        for indices, rows in row_blocks(*args):
            read.append(rows.nbytes if len(rows) > 1 else 0)  # one row may be larger than a block
            yield indices, rows

    def writing(ref, indices, updates, **kwargs):
        written.append((updates.dtype, int(tf.size(updates))))
        return scatter(ref=ref, indices=indices, updates=updates, **kwargs)

    def whole(*args, **kwargs):
        raise AssertionError("a tensor read whole")
    monkeypatch.setattr(bundle, "row_blocks", reading)
    monkeypatch.setattr(tf.raw_ops, "ResourceScatterNdUpdate", writing)
    monkeypatch.setattr(tf.raw_ops, "RestoreV2", whole)
    monkeypatch.setattr(tf.train, "load_checkpoint", whole)
    for dtype in ("float32", "bfloat16"):
        read.clear()
        written.clear()
        model = load_model(small_vocab_dir, dtype=dtype)
        assert max(read) <= 1000 and {d for d, _ in written} == {tf.as_dtype(dtype)}
        assert sum(n for _, n in written) == sum(int(np.prod(v.shape)) for v in model.weights)
        for v in model.weights:
            np.testing.assert_array_equal(v.numpy(), tf.cast(values[v.path], dtype).numpy(), err_msg=v.path)


def test_corrupt_index_block(folder):
    """A byte changed inside the index: its block's checksum says so."""
    index = folder / "model.ckpt.index"
    raw = bytearray(index.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    index.write_bytes(bytes(raw))
    with pytest.raises(bundle.BundleError, match="checksum"):
        bundle.read_index(str(folder / "model.ckpt"))
    with pytest.raises(CheckpointError, match=r"model\.ckpt\.index: cannot read"):
        load_model(folder)


def test_save_roundtrip_and_layout(tiny_dir, tmp_path):
    model = load_model(tiny_dir)
    model.h[0].attn.c_attn.b.assign(model.h[0].attn.c_attn.b + 1.0)  # so we know it is ours
    out = tmp_path / "saved"
    save_model(model, out)
    assert sorted(os.listdir(out)) == ["checkpoint", "hparams.json", "model.ckpt.data-00000-of-00001",
                                       "model.ckpt.index"]
    assert json.loads((out / "hparams.json").read_text()) == model.hparams.values()
    again = load_model(out)
    for a, b in zip(model.weights, again.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


@pytest.mark.slow
def test_saved_checkpoint_restores_in_reference(tiny_dir, reference_tiny, tmp_path):
    model = load_model(tiny_dir)
    model.ln_f.b.assign(model.ln_f.b + 0.5)
    out = str(tmp_path / "saved")
    save_model(model, out)
    tokens = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    with Reference(str(require_reference()), out) as ref:
        theirs = ref.model(tokens)["logits"]
    before = reference_tiny.model(tokens)["logits"]
    ours = model(tokens)["logits"].numpy()
    assert np.abs(ours - theirs).max() <= ATOL
    assert np.abs(before - theirs).max() > 0.1, "the reference did not restore the saved weights"


def test_optimizer_slots_and_global_step_are_ignored(tiny_dir, tmp_path):
    hparams = load_hparams(tiny_dir)
    tensors = random_weights(hparams, std=0.2, seed=3)
    tensors.update({name + "/Adam": np.zeros_like(value) for name, value in list(tensors.items())[:3]})
    tensors["global_step"] = np.array(1000, np.int64)
    save_checkpoint(tensors, hparams, tmp_path / "finetuned")
    model = load_model(tmp_path / "finetuned")
    np.testing.assert_array_equal(model.wte.numpy(), tensors["model/wte"])


def test_untied_model_from_original_checkpoint_starts_with_wte_head(tiny_dir, tmp_path):
    model = load_model(tiny_dir, tie_embeddings=False)
    np.testing.assert_array_equal(model.out_head.numpy(), model.wte.numpy())
    model.out_head.assign(model.out_head * 0.5)
    save_model(model, tmp_path / "untied")
    again = load_model(tmp_path / "untied", tie_embeddings=False)
    np.testing.assert_array_equal(again.out_head.numpy(), model.out_head.numpy())
    with pytest.raises(CheckpointError, match="tie_embeddings=False"):
        load_model(tmp_path / "untied")


def test_missing_folder_and_files(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        load_model(tmp_path / "nope")
    os.remove(folder / "checkpoint")
    with pytest.raises(FileNotFoundError, match=r"checkpoint: no such file"):
        load_model(folder)
    os.rename(folder / "model.ckpt.data-00000-of-00001", folder / "data")
    with pytest.raises(FileNotFoundError, match=r"model\.ckpt\.data-00000-of-00001: no such file"):
        load_model(folder, checkpoint=str(folder / "model.ckpt"))
    os.remove(folder / "model.ckpt.index")
    with pytest.raises(FileNotFoundError, match=r"model\.ckpt\.index: no such file"):
        load_model(folder, checkpoint=str(folder / "model.ckpt"))
    os.remove(folder / "hparams.json")
    with pytest.raises(FileNotFoundError, match=r"hparams\.json: no such file"):
        load_model(folder)


def test_checkpoint_file_naming_a_missing_prefix(folder, capfd, caplog):
    """One clean error, without TensorFlow's `ERROR:tensorflow:Couldn't match files` before it."""
    (folder / "checkpoint").write_text('model_checkpoint_path: "gone.ckpt"\n')
    with pytest.raises(CheckpointError, match=r"checkpoint: names checkpoint 'gone\.ckpt', which does not exist "
                                              r"in .*\(no .*gone\.ckpt\.index\)$"):
        load_model(folder)
    assert "ERROR" not in capfd.readouterr().err and not caplog.records
    (folder / "checkpoint").write_text("all_model_checkpoint_paths: \"model.ckpt\"\n")
    with pytest.raises(CheckpointError, match=r"checkpoint: names no checkpoint \(no model_checkpoint_path"):
        load_model(folder)
    (folder / "checkpoint").write_text(f'model_checkpoint_path: "{folder / "model.ckpt"}"\n')  # absolute
    assert load_model(folder).hparams.n_layer == 2


def test_truncated_data_file(folder):
    data = folder / "model.ckpt.data-00000-of-00001"
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(CheckpointError, match=r"data-00000-of-00001: cannot read tensor 'model/"):
        load_model(folder)


def test_corrupt_data_file(folder):
    data = folder / "model.ckpt.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"cannot read tensor .*(checksum|corrupt)"):
        load_model(folder)


def test_weights_that_are_not_finite_are_refused_naming_the_tensor(tmp_path, signals):
    """A diverged run's NaN (or inf) weights: one line naming the file and the tensor, from the
    library and from `tfgpt2 generate`, rather than text from NaN logits."""
    from tfgpt2.cli import generate
    hparams = default_hparams().override_from_dict(dict(TINY, n_layer=1))
    for value in (np.nan, np.inf):
        weights = random_weights(hparams)
        weights["model/h0/mlp/c_fc/w"][0, 3, 5] = value
        save_checkpoint(weights, hparams, str(tmp_path / "diverged"))
        message = r"model.ckpt.data-00000-of-00001: tensor 'model/h0/mlp/c_fc/w' holds NaN or inf values"
        with pytest.raises(CheckpointError, match=message):
            load_model(str(tmp_path / "diverged"))
    with pytest.raises(SystemExit, match=f"^error: .*{message}"):
        generate.main(["--model_dir", str(tmp_path / "diverged"), "--nsamples", "1", "--length", "2"])


def test_corrupt_index_file(folder):
    (folder / "model.ckpt.index").write_bytes(b"not an index")
    with pytest.raises(CheckpointError, match=r"model\.ckpt\.index: cannot read the checkpoint"):
        load_model(folder)


@pytest.mark.parametrize("change, message", [
    ({"n_embd": 128}, r"shape mismatch: model/wpe: checkpoint \[64, 64\], hparams expect \[64, 128\]"),
    ({"n_layer": 3}, r"missing variables: model/h2/attn/c_attn/b"),
    ({"n_layer": 1}, r"variables the hparams do not have: model/h1/"),
    ({"n_vocab": 50000}, r"model/wte: checkpoint \[50257, 64\], hparams expect \[50000, 64\]"),
])
def test_hparams_that_disagree_with_checkpoint(folder, change, message):
    hparams = json.loads((folder / "hparams.json").read_text())
    hparams.update(change)
    (folder / "hparams.json").write_text(json.dumps(hparams))
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)


def test_bad_hparams_json(folder):
    hparams = json.loads((folder / "hparams.json").read_text())
    (folder / "hparams.json").write_text(json.dumps(dict(hparams, n_embd=65)))
    with pytest.raises(ValueError, match=r"hparams\.json: .*n_embd \(65\) must be divisible by hparams\.n_head"):
        load_model(folder)
    (folder / "hparams.json").write_text(json.dumps(dict(hparams, n_embed=64)))
    with pytest.raises(ValueError, match=r"unknown hparams \['n_embed'\]"):
        load_model(folder)
    del hparams["n_layer"]
    (folder / "hparams.json").write_text(json.dumps(hparams))
    with pytest.raises(ValueError, match=r"hparams\.json: missing n_layer; "):
        load_model(folder)
    (folder / "hparams.json").write_text('{"n_vocab": 50257,')
    with pytest.raises(ValueError, match=r"hparams\.json: not valid JSON"):
        load_model(folder)


def test_interrupted_save_leaves_no_file(tiny_dir, tmp_path, monkeypatch):
    model = load_model(tiny_dir)
    out = tmp_path / "out"

    def broken_save(**kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(tf.raw_ops, "SaveV2", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, out)
    assert os.listdir(out) == []
