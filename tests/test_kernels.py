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

from tests.helpers import all_nodes
from tfgpt2 import kernels, load_model
from tfgpt2.decoding import layouts
from tfgpt2.decoding.cache import BLOCK, cached_attn, call_with_cache, empty_cache
from tfgpt2.decoding.slots import FLOATS, INTS, Slots
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


def attention_case(dtype, d, seed=0):
    """Blocks of 3 slots x 2 heads in 3 blocks of 8 positions, and a query row per (row, head)
    of rows in slots 2, 0, 1 and 1 at positions inside the first block, at the second's last,
    past the blocks' end (read to their end, written nowhere) and from a first position in the
    second block (a left-padded row), each with a new key and value: (q [rows, heads, 1, d],
    rows, first, last, k_new, v_new, k, v)."""
    rng = np.random.default_rng(seed)
    slots, heads, length, count = 3, 2, 8, 3
    k, v = ([tf.constant(rng.normal(0, 1, [slots * heads, length, d]), tf.float32) for _ in range(count)]
            for _ in range(2))
    at = np.array([[2, 0, 5], [0, 0, 15], [1, 0, 40], [1, 11, 20]])  # (slot, first, last) of each row
    q = tf.cast(rng.normal(0, 2, [len(at), heads, 1, d]), dtype)
    rows = (at[:, :1] * heads + np.arange(heads)).reshape(-1).astype(np.int32)
    first, last = (np.repeat(at[:, i], heads).astype(np.int32) for i in (1, 2))
    k_new, v_new = (tf.constant(rng.normal(0, 1, [len(rows), d]), tf.float32) for _ in range(2))
    return q, rows, first, last, k_new, v_new, k, v


def written(blocks, rows, last, new):
    """The blocks (numpy) with each row's new values at its last position (none past the end)."""
    blocks = [b.numpy().copy() for b in blocks]
    length = blocks[0].shape[1]
    for row, at, values in zip(rows, last, new.numpy()):
        if at < length * len(blocks):
            blocks[at // length][row, at % length] = values
    return blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("d", [64, 20])
def test_cached_attention_writes_then_is_cached_attn_over_the_rows_blocks(dtype, d):
    """`cached_attention` writes each row's new key and value at its last position of its cache
    row (in place: the blocks it returns), then reads that row from its first position to its
    last: the blocks so written, and `cache.cached_attn` over each row's blocks (gathered) under
    that mask, give the same blocks, the same bfloat16 bits, and float32 values within float32's
    rounding."""
    needs(dtype)
    q, rows, first, last, k_new, v_new, k, v = attention_case(tf.as_dtype(dtype), d)
    scale = tf.math.rsqrt(tf.cast(d, tf.float32))
    got, k_out, v_out = tf.function(lambda q: kernels.cached_attention(
        tf.reshape(q, [-1, d]), rows, first, last, k_new, v_new, k, v, scale), jit_compile=True)(q)
    assert got.dtype == q.dtype and got.shape == (len(rows), d)
    k_held, v_held = written(k, rows, last, k_new), written(v, rows, last, v_new)
    for out, held in zip(list(k_out) + list(v_out), k_held + v_held):
        np.testing.assert_array_equal(out.numpy(), held)
    assert not np.array_equal(k_held[0], k[0].numpy())  # some were written
    positions = np.arange(24)
    mask = tf.cast((first[::2, None, None] <= positions) & (np.minimum(last[::2], 23)[:, None, None] >= positions),
                   q.dtype)
    expected = tf.function(lambda q: cached_attn(q, [tf.gather(b, rows) for b in k_held],
                                                 [tf.gather(b, rows) for b in v_held], mask), jit_compile=True)(q)
    got, expected = (tf.cast(t, tf.float32).numpy().reshape(len(rows), d) for t in (got, expected))
    if dtype == "bfloat16":
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    # each row attends to its own positions: another row's answer, or all positions', differs
    assert np.abs(got[0] - got[2]).max() > 0.1 and np.abs(got[4] - got[6]).max() > 0.1


def test_cached_attention_of_mismatched_blocks_names_the_shapes():
    needs(tf.float32)
    q, rows, first, last, k_new, v_new, k, v = attention_case(tf.float32, 16)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"got q \[8,16\], rows \[8\], first \[8\], "
                                                             r"last \[8\], scale \[\], k_new \[8,16\], .*v \[6,8,8\]"):
        tf.function(lambda q: kernels.cached_attention(q, rows, first, last, k_new, v_new, k, k[:2] + [v[2][..., :8]],
                                                        tf.constant(0.25)), jit_compile=True)(tf.reshape(q, [-1, 16]))


def test_cached_attention_of_a_row_outside_the_cache_names_it():
    """A cache row or positions out of range raise, naming them, before anything is written."""
    needs(tf.float32)
    q, rows, first, last, k_new, v_new, k, v = attention_case(tf.float32, 16)
    run = tf.function(lambda rows, first: kernels.cached_attention(tf.reshape(q, [-1, 16]), rows, first, last, k_new,
                                                                   v_new, k, v, tf.constant(0.25)), jit_compile=True)
    outside = tf.tensor_scatter_nd_update(rows, [[3]], [int(k[0].shape[0])])
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"row 3 reads cache row {k[0].shape[0]} of "
                                                             rf"{k[0].shape[0]}, positions"):
        run(outside, first)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"row 0 reads cache row .* positions -1 to"):
        run(rows, tf.tensor_scatter_nd_update(first, [[0]], [-1]))


def attention_ops(function, *specs):
    graph_def = tf.function(function).get_concrete_function(*specs).graph.as_graph_def()
    return sum(n.op == "CachedAttention" for n in all_nodes(graph_def))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_of_one_new_position_attend_by_the_kernel(tiny_dir, dtype):
    """With the row kernels' layouts, a step of one new position per row attends by the kernel,
    one per layer: `generate`'s over its float32 cache, and the server's over fewer rows than
    its slots; a prompt's chunk, and a step over all the slots (whose blocks XLA's products read
    in place), keep XLA's products."""
    needs(dtype)
    model = load_model(tiny_dir, dtype=dtype)
    n_layer, steps = model.hparams.n_layer, layouts.rows(model)
    cache = empty_cache(model, 1, 64, tf.float32)
    for width, expected in [(1, n_layer), (4, 0)]:
        assert attention_ops(lambda X: call_with_cache(model, X, cache, 5, layouts=steps),
                             tf.TensorSpec([1, width], tf.int32)) == expected
    slots = Slots(model, max_batch=4, chunk=16, steps=2, eot=0)
    for rows, expected in [(1, n_layer), (2, n_layer), (4, 0)]:
        specs = (tf.TensorSpec([len(INTS), rows], tf.int32), tf.TensorSpec([len(FLOATS), rows], tf.float32),
                 tf.TensorSpec([rows], tf.int64))
        assert attention_ops(lambda *a: slots._decode(*a, window=64, stops=(None, None)), *specs) == expected


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


ONE_CPU = """
import os, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before TensorFlow's threads: theirs too
import numpy as np, tensorflow as tf
from tfgpt2 import kernels
x, w = tf.random.normal([1, 256]), tf.random.normal([1024, 256])
calls = {parts: tf.function(lambda x, w, parts=parts: [kernels.library().row_product(x, w, U=tf.float32, parts=parts)
                                                      for _ in range(50)], jit_compile=True) for parts in (1, 2)}
seconds = {1: [], 2: []}
for _ in range(7):
    for parts, call in calls.items():
        call(x, w)
        start = time.perf_counter()
        for _ in range(10):
            call(x, w)
        seconds[parts].append(time.perf_counter() - start)
print(np.median(seconds[2]) / np.median(seconds[1]))
"""


@pytest.mark.slow  # a TensorFlow process of its own, on one CPU
def test_a_part_whose_thread_the_system_has_not_run_is_taken_by_the_caller():
    """On one CPU (a busy host at its worst: the kernels' thread waits its turn behind the caller)
    a product in two parts costs about what it does in one, as the caller runs the part left
    unclaimed; waiting for the thread, it cost 20x (and a tiny model's decoding step under a
    CPU-bound neighbour up to 15x)."""
    needs(tf.float32)
    run = subprocess.run([sys.executable, "-c", ONE_CPU], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout) < 5


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
