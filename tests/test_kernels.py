"""`tfgpt2.kernels`: the products on the CPU's AVX-512 instructions (BF16, VNNI), against NumPy
(bfloat16 and float32 to float32's rounding of the sums, int8 exactly), their build, and where
decoding reads its weights by them."""
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfgpt2 import kernels, load_model
from tfgpt2.decoding import layouts
from tfgpt2.decoding.cache import BLOCK
from tfgpt2.decoding.slots import Slots
from tfgpt2.decoding.generator import generator_for
from tfgpt2.sample import generate

# (rows, nx, nf): a decoding row at GPT-2's widths; tails of nx under a vector and of nf under a
# group of rows; more rows than one; fewer outputs than the parts
SHAPES = [(1, 768, 2304), (3, 40, 13), (5, 100, 70), (2, 64, 3)]


def needs(dtype):
    if not kernels.supports(dtype):
        pytest.skip(f"no {tf.as_dtype(dtype).name} row kernel here: the CPU lacks the instructions "
                    "(AVX-512 BF16 or VNNI), or it could not be built (tfgpt2.kernels)")


def product(x, w):
    return tf.function(kernels.row_product, jit_compile=True)(x, w)


@pytest.mark.parametrize("m, nx, nf", SHAPES)
def test_bfloat16_rows_are_numpys_products_of_the_bfloat16_values(m, nx, nf):
    needs(tf.bfloat16)
    rng = np.random.default_rng(nx)
    x, w = (tf.cast(rng.normal(0, 1, shape), tf.bfloat16) for shape in ((m, nx), (nf, nx)))
    y = product(x, w)
    assert y.dtype == tf.float32 and y.shape == (m, nf)
    expected = tf.cast(x, tf.float64).numpy() @ tf.cast(w, tf.float64).numpy().T
    # float32 sums of nx exact products: within nx float32 roundings of the largest partial sum
    bound = nx * 2 ** -23 * (np.abs(tf.cast(x, tf.float64).numpy()) @ np.abs(tf.cast(w, tf.float64).numpy()).T)
    assert np.all(np.abs(y.numpy() - expected) <= bound), np.max(np.abs(y.numpy() - expected) / bound)
    assert np.abs(expected).max() > 1


@pytest.mark.parametrize("m, nx, nf", SHAPES)
def test_biased_bfloat16_rows_round_as_a_bfloat16_layer(m, nx, nf):
    """`biased_row_product`: the bfloat16 product rounded to bfloat16, b added, rounded (as a
    bfloat16 `Conv1D` computes x @ w + b), the same bits as those steps after `row_product`."""
    needs(tf.bfloat16)
    rng = np.random.default_rng(nx)
    x, w, b = (tf.cast(rng.normal(0, 1, shape), tf.bfloat16) for shape in ((m, nx), (nf, nx), (nf,)))
    y = tf.function(kernels.biased_row_product, jit_compile=True)(x, w, b)
    assert y.dtype == tf.bfloat16 and y.shape == (m, nf)
    steps = tf.cast(tf.cast(product(x, w), tf.bfloat16) + b, tf.float32).numpy()
    np.testing.assert_array_equal(tf.cast(y, tf.float32).numpy(), steps)
    assert not np.array_equal(steps, tf.cast(tf.cast(product(x, w), tf.bfloat16), tf.float32).numpy())  # b added


@pytest.mark.parametrize("m, nx, nf", SHAPES)
def test_float32_rows_and_columns_are_numpys_products(m, nx, nf):
    """`row_product` of w [nf, nx] and `column_product` of w [nx, nf] (a layer's own weight,
    its rows split between the parts and the parts' sums added)."""
    needs(tf.float32)
    rng = np.random.default_rng(nx)
    x, w = (rng.normal(0, 1, shape).astype(np.float32) for shape in ((m, nx), (nx, nf)))
    expected = x.astype(np.float64) @ w.astype(np.float64)
    bound = nx * 2 ** -23 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    rows = product(tf.constant(x), tf.constant(w.T))
    columns = tf.function(kernels.column_product, jit_compile=True)(tf.constant(x), tf.constant(w))
    for y in rows, columns:
        assert y.dtype == tf.float32 and y.shape == (m, nf)
        assert np.all(np.abs(y.numpy() - expected) <= bound), np.max(np.abs(y.numpy() - expected) / bound)
    assert np.abs(expected).max() > 1


@pytest.mark.parametrize("m, nx, nf", SHAPES)
def test_int8_rows_are_numpys_exact_integer_products(m, nx, nf):
    needs(tf.int8)
    rng = np.random.default_rng(nx)
    x, w = (rng.integers(-128, 128, shape).astype(np.int8) for shape in ((m, nx), (nf, nx)))
    x[0, :3] = [-128, 127, 0]  # the ends of the range (x is read as x + 128)
    y = product(tf.constant(x), tf.constant(w))
    assert y.dtype == tf.int32
    np.testing.assert_array_equal(y.numpy(), x.astype(np.int64) @ w.astype(np.int64).T)


def test_a_product_of_mismatched_widths_names_both_shapes():
    needs(tf.int8)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"got x \[2,8\] and w \[4,16\]"):
        product(tf.zeros([2, 8], tf.int8), tf.zeros([4, 16], tf.int8))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[nx, nf\]; got x \[2,8\] and w \[16,8\]"):
        tf.function(kernels.column_product, jit_compile=True)(tf.zeros([2, 8]), tf.zeros([16, 8]))
    if kernels.supports(tf.bfloat16):
        x, w, b = (tf.zeros(shape, tf.bfloat16) for shape in ([2, 8], [4, 8], [5]))
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"got x \[2,8\], w \[4,8\] and b \[5\]"):
            tf.function(kernels.biased_row_product, jit_compile=True)(x, w, b)


def test_a_failed_build_warns_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TFGPT2_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    monkeypatch.setattr(kernels, "cpu_has", lambda flags: True)
    with pytest.warns(UserWarning, match="building rows.cc failed"):
        assert kernels.library.__wrapped__() is None
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(subprocess.CalledProcessError):
        kernels.build(["false"], tmp_path / "rows.so")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("TFGPT2_KERNELS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.library.__wrapped__() is None  # turned off: not built, nothing said


CACHED = """
import json, numpy as np, tensorflow as tf
from tfgpt2 import kernels
x, w = np.arange(6, dtype=np.float32).reshape(1, 6) / 7, np.arange(18, dtype=np.float32).reshape(6, 3) / 5
both = tf.function(lambda x, w: (kernels.column_product(x, w), kernels.row_product(tf.cast(x, tf.bfloat16),
                                 tf.cast(tf.transpose(w), tf.bfloat16))), jit_compile=True)
print(json.dumps([y.numpy().tolist() for y in both(x, w)]))
"""


@pytest.mark.slow
def test_a_program_holding_the_kernels_loads_from_xlas_persistent_cache(tmp_path):
    """The kernels are typed XLA FFI handlers: a program compiled in one process and loaded from
    XLA's persistent cache in the next gives the same products (an untyped custom call crashed
    the second process)."""
    needs(tf.bfloat16)
    env = dict(os.environ, TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={tmp_path}", TF_CPP_MIN_LOG_LEVEL="3")
    first, second = (subprocess.run([sys.executable, "-c", CACHED], env=env, capture_output=True, text=True, timeout=300)
                     for _ in range(2))
    assert first.returncode == second.returncode == 0, second.stderr[-2000:]
    assert list(tmp_path.iterdir()) and first.stdout == second.stdout
    expected = (np.arange(6).reshape(1, 6) / 7) @ (np.arange(18).reshape(6, 3) / 5)
    columns, rows = json.loads(first.stdout)
    np.testing.assert_allclose(columns, expected, rtol=1e-6)
    np.testing.assert_allclose(rows, expected, rtol=2e-2)  # bfloat16 operands


def test_huge_pages_back_the_whole_2mb_pages_inside_a_tensor():
    """`huge_pages` moves the 2 MB pages inside a tensor's buffer to huge pages (a 16 MB tensor:
    7 or 8 of them, as its start falls), its values unchanged; again, the same pages."""
    if kernels.library() is None:
        pytest.skip("the kernels' library is not built here (tfgpt2.kernels)")
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("Linux's transparent huge pages are off here")
    if tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2]) < (6, 1):
        pytest.skip("MADV_COLLAPSE needs Linux 6.1")
    t = tf.random.normal([4 << 20])
    values = t.numpy().copy()
    moved = kernels.huge_pages([t])
    assert moved in (7 << 21, 8 << 21), moved
    np.testing.assert_array_equal(t.numpy(), values)
    assert kernels.huge_pages([t]) == moved


def test_decoding_moves_the_weights_to_huge_pages(tiny_dir, monkeypatch):
    """`generate` asks for the model's weights once (its Generator's first call); the server's
    slots, at their start, for the weights and the layouts they hold."""
    asked = []
    monkeypatch.setattr(kernels, "huge_pages", lambda tensors: asked.append(list(tensors)) or 0)
    model = load_model(tiny_dir)
    for _ in range(2):
        generate(model, [[1, 2, 3]], 2)
    assert len(asked) == 1 and len(asked[0]) == len(model.weights)
    Slots(model, max_batch=2, chunk=BLOCK, steps=1, eot=0)
    assert len(asked) == 2 and len(asked[1]) >= len(model.weights)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512bw avx512_vnni\n")
    assert kernels.cpu_has(kernels.FLAGS[tf.int8], str(cpuinfo))
    assert not kernels.cpu_has(kernels.FLAGS[tf.bfloat16], str(cpuinfo))
    assert not kernels.cpu_has(("avx512f",), str(tmp_path / "none"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_models_steps_read_its_weights_by_the_kernels(tiny_dir, dtype, batch):
    """At batch <= `layouts.ROWS` on a CPU under XLA the steps' block weights are read by the
    kernels: a float32 model's own weights as `layouts.Columns`, a bfloat16 model's [nf, nx]
    copies and an int8 model's own int8 weights as `layouts.Rows`; greedy generation then picks
    what the model's own eager logits pick, row by row (tests/test_low_precision_doors.py and
    tests/test_doors.py: every door)."""
    needs(dtype)
    model = load_model(tiny_dir, dtype=dtype)
    steps = generator_for(model).weights_for(16, batch, 5)[1]
    assert layouts.by_rows(steps) and len(steps) == model.hparams.n_layer
    c_attn = model.h[0].attn.c_attn
    expected = {"int8": c_attn.w, "float32": c_attn.w[0]}.get(dtype, tf.transpose(model.as_compute(c_attn.w)[0]))
    np.testing.assert_array_equal(steps[0][0].w.numpy(), expected.numpy())
    assert steps[0][0].w.dtype == tf.as_dtype(dtype)
    assert isinstance(steps[0][0], layouts.Columns if dtype == "float32" else layouts.Rows)
    assert not layouts.by_rows(generator_for(model).weights_for(16, layouts.ROWS + 1, 5)[1])  # XLA's products
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]][:batch] + [[9, 9, 9, 9, 9]] * (batch - 2)
    for prompt, tokens in zip(prompts, generate(model, prompts, 6, top_k=1)):
        tokens = tokens.tolist()
        for n in range(len(prompt), len(tokens)):  # each token the argmax of the eager logits
            logits = model(tf.constant([tokens[:n]]))["logits"][0, -1].numpy()
            assert logits[tokens[n]] >= logits.max() - (0.25 if dtype == "bfloat16" else 1e-4), n
