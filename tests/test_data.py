"""The forks' data: text/folder/glob/.npz chunks, --combine, windows inside chunks drawn from
(seed, step), a held-out validation part, and `tfgpt2 encode`."""
import numpy as np
import pytest
import tensorflow as tf

import tfgpt2
from tfgpt2.cli import encode
from tfgpt2.train import data

EOT = 50256


@pytest.fixture(scope="module")
def enc():
    return tfgpt2.default_encoder()


def test_text_files_are_joined_with_endoftext_until_combine(enc, tmp_path):
    for name, text in [("a.txt", "One fish."), ("b.txt", "Two fish."), ("sub/c.txt", "Red fish <|endoftext|> blue")]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    chunks = data.load_dataset(enc, str(tmp_path), combine=12)
    assert [c.tolist() for c in chunks] == [
        enc.encode("One fish.") + [EOT] + enc.encode("Two fish."),
        enc.encode("Red fish ") + [EOT] + enc.encode(" blue")]
    assert len(data.load_dataset(enc, str(tmp_path), combine=50000)) == 1
    assert [c.tolist() for c in data.load_dataset(enc, str(tmp_path / "*.txt"), combine=1)] == [
        enc.encode("One fish."), enc.encode("Two fish.")]
    assert [c.tolist() for c in data.load_dataset(enc, str(tmp_path / "a.txt"))] == [enc.encode("One fish.")]


def test_npz_chunks_round_trip_through_encode(enc, tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"{i}.txt").write_text(f"Text number {i}. " * 20)
    encode.main([str(tmp_path / "in"), str(tmp_path / "out.npz"), "--combine", "500"])
    with np.load(tmp_path / "out.npz") as npz:
        assert npz.files == ["arr_0", "arr_1"]
    chunks = data.load_dataset(enc, str(tmp_path / "out.npz"))
    expected = data.load_dataset(enc, str(tmp_path / "in"), combine=500)
    assert [c.tolist() for c in chunks] == [c.tolist() for c in expected]
    assert not list(tmp_path.glob("*.tmp*"))


def test_windows_never_cross_a_chunk_and_cover_every_position(tmp_path):
    chunks = [np.arange(0, 10), np.arange(100, 103), np.arange(200, 206)]
    windows = data.Windows(chunks, 4)
    assert windows.count == 7 + 0 + 3
    every = windows.take(tf.range(windows.count, dtype=tf.int64)).numpy()
    assert every[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 200, 201, 202]
    assert (np.diff(every, axis=1) == 1).all()  # each window is consecutive ids of one chunk
    drawn = windows.take(windows.draw(0, 1, 2000)).numpy()
    counts = np.unique(drawn[:, 0], return_counts=True)[1]
    assert len(counts) == 10 and counts.min() > 120  # uniform over the 10 windows


def test_the_pipeline_has_static_shapes_and_each_step_its_own_windows():
    windows = data.Windows([np.arange(1000)], 17)
    ds = data.training_dataset(windows, batch_size=3, seed=5, steps=4)
    assert ds.element_spec.shape.as_list() == [3, 17]
    batches = list(ds.as_numpy_iterator())
    assert len(batches) == 4
    resumed = list(data.training_dataset(windows, batch_size=3, seed=5, start_step=2, steps=4).as_numpy_iterator())
    np.testing.assert_array_equal(np.stack(batches[2:]), np.stack(resumed))
    other_seed = next(data.training_dataset(windows, batch_size=3, seed=6).as_numpy_iterator())
    assert not np.array_equal(other_seed, batches[0])
    x, y = next(iter(data.keras_dataset(windows, batch_size=3, seed=5)))
    np.testing.assert_array_equal(x.numpy()[:, 1:], y.numpy()[:, :-1])
    assert x.shape == (3, 16)


def test_held_out_tokens_are_never_in_training_windows():
    chunks = [np.arange(0, 60), np.arange(1000, 1040)]
    train, held_out = data.split_validation(chunks, 0.25)
    assert [c.tolist() for c in train] == [list(range(60)), list(range(1000, 1015))]
    assert [c.tolist() for c in held_out] == [list(range(1015, 1040))]
    seen = data.Windows(train, 8).take(tf.range(data.Windows(train, 8).count, dtype=tf.int64)).numpy()
    assert not set(seen.ravel()) & set(held_out[0].tolist())
    fixed = data.fixed_batches(data.Windows(held_out, 8), batch_size=2, count=3)
    assert fixed.shape == (3, 2, 8) and set(fixed.ravel()) <= set(held_out[0].tolist())


def test_bad_datasets_are_clear_errors(enc, tmp_path):
    with pytest.raises(data.DatasetError, match="nothing.txt: no such file"):
        data.load_dataset(enc, str(tmp_path / "nothing.txt"))
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(data.DatasetError, match=r"bad.txt: not valid utf-8 at byte 3 \(pass --encoding"):
        data.load_dataset(enc, str(tmp_path / "bad.txt"))
    assert data.load_dataset(enc, str(tmp_path / "bad.txt"), encoding="latin-1")[0].tolist() == enc.encode("café")
    np.savez_compressed(tmp_path / "ids.npz", np.array([1, -2]))
    with pytest.raises(data.DatasetError, match=r"arr_0\[1\] is token id -2, outside \[0, n_vocab=50257\)"):
        data.load_dataset(enc, str(tmp_path / "ids.npz"), n_vocab=50257)
    np.savez_compressed(tmp_path / "floats.npz", np.zeros([2, 2]))
    with pytest.raises(data.DatasetError, match="arr_0 is float64 of shape"):
        data.load_dataset(enc, str(tmp_path / "floats.npz"))
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    with pytest.raises(data.DatasetError, match="broken.npz: not a readable .npz"):
        data.load_dataset(enc, str(tmp_path / "broken.npz"))
    np.savez_compressed(tmp_path / "whole.npz", np.arange(5000) % 50257)
    whole = (tmp_path / "whole.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[:len(whole) // 2])  # a copy that stopped half way: a zip's start
    with pytest.raises(data.DatasetError, match=r"cut.npz: not a readable .npz file \(BadZipFile"):
        data.load_dataset(enc, str(tmp_path / "cut.npz"))
    with pytest.raises(data.DatasetError, match="the longest 3; a training window needs 5"):
        data.Windows([np.arange(3), np.arange(2)], 5, name="small")
    with pytest.raises(data.DatasetError, match="0 tokens in 0 chunks"):
        data.Windows([], 5)


def test_noise_replaces_a_share_of_the_tokens_as_the_forks():
    """The forks' --noise: each token, with probability p, becomes an id drawn from [0, n_vocab);
    the same for the same seed (a resumed run draws it again), other for another."""
    tokens = tf.constant(np.arange(20000).reshape(4, 5000) % 50257, tf.int32)
    seed = tf.constant([1, 2], tf.int64)
    out = data.noised(tokens, 0.25, 50257, seed).numpy()
    assert 0.235 < (out != tokens.numpy()).mean() < 0.265 and out.min() >= 0 and out.max() < 50257
    np.testing.assert_array_equal(out, data.noised(tokens, 0.25, 50257, seed).numpy())
    assert (out != data.noised(tokens, 0.25, 50257, seed + 1).numpy()).any()
    np.testing.assert_array_equal(data.noised(tokens, 0.0, 50257, seed).numpy(), tokens.numpy())
