"""Keras quantization of the model (`model.quantize("int8")`, as Keras's Dense): every block
Conv1D quantized, logits close to the float model's, generation and the SavedModel on the
quantized model, the `.keras` file round trip in a fresh process, and the float weights'
checkpoint names kept."""
import subprocess
import sys
import warnings

import numpy as np
import pytest

from tests.helpers import ROOT, TINY

IDS = [[464, 3290, 286, 1204, 318, 257, 1332, 11, 290, 340, 373, 13]]


@pytest.fixture(scope="module")
def tiny_01_dir(tmp_path_factory):
    from tfgpt2.hparams import default_hparams
    from tfgpt2.testing.checkpoints import make_checkpoint
    return make_checkpoint(str(tmp_path_factory.mktemp("models") / "tiny01"),
                           default_hparams().override_from_dict(TINY), std=0.1, seed=3)


@pytest.mark.slow
def test_quantize_int8(tiny_01_dir, tmp_path):
    """Logits within 0.3 of the float model's (measured: 0.13 at std 0.1), the same argmax at
    >= 90% of positions; greedy generation equals the argmax of uncached forward passes; the
    `.keras` file loads in a fresh process with identical logits."""
    from tfgpt2 import generate, load_model
    from tfgpt2.model import Conv1D
    model = load_model(tiny_01_dir)
    names = {v.path: v.dtype for v in model.weights}
    expected = model(IDS)["logits"].numpy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.quantize("int8")
    assert not [w for w in caught if "Conv1D" in str(w.message)]
    convs = [layer for layer in model._flatten_layers() if isinstance(layer, Conv1D)]
    assert len(convs) == 4 * TINY["n_layer"]
    assert all(c.quantization_mode == "int8" and c.w.dtype == "int8" for c in convs)
    assert all(c.w.shape == (c.nf, c.nx) for c in convs)  # transposed: each output's weights contiguous
    after = {v.path: v.dtype for v in model.weights}
    assert set(after) - set(names) == {c.w_scale.path for c in convs} | {"model/wte_int8", "model/wte_scale"}
    assert after["model/wte_int8"] == "int8" and after["model/wte"] == "float32"  # the lookup reads the float wte
    assert {p for p in names if after[p] != names[p]} == {c.w.path for c in convs}

    logits = model(IDS)["logits"].numpy()
    assert np.abs(logits - expected).max() < 0.3
    assert np.mean(logits.argmax(-1) == expected.argmax(-1)) >= 0.9

    tokens = generate(model, [IDS[0][:3]], 20, temperature=0)[0]  # 20: past layouts.TRANSPOSE_FROM
    forward = model(tokens[None, :-1])["logits"].numpy()[0, 2:].argmax(-1)
    assert tokens[3:].tolist() == forward.tolist()

    path = tmp_path / "q.keras"
    model.save(path)
    code = ("import sys, numpy as np, keras, tfgpt2; m = keras.models.load_model(sys.argv[1]); "
            f"np.save(sys.argv[2], m({IDS})['logits'].numpy())")
    subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "l.npy")], check=True, cwd=ROOT)
    np.testing.assert_array_equal(np.load(tmp_path / "l.npy"), logits)


def test_an_int8_weight_stored_untransposed_loads_and_a_wrong_shape_is_named():
    """An int8 Conv1D's `w` from a file that holds it as [1, nx, nf] (written before int8
    weights were held as [nf, nx]) loads transposed; a value of another shape is refused with
    the layer, the variable and both shapes."""
    from tfgpt2.model import Conv1D
    layer = Conv1D(4, 6, name="c_fc")
    layer.build()
    layer.quantize("int8")
    w = np.arange(24, dtype=np.int8).reshape([1, 4, 6])
    layer.load_own_variables({"0": w, "1": np.ones(6, np.float32), "2": np.full(6, 2.0, np.float32)})
    np.testing.assert_array_equal(layer.w.numpy(), w[0].T)
    np.testing.assert_array_equal(layer.w_scale.numpy(), np.full(6, 2.0))
    with pytest.raises(ValueError, match=r"c_fc: the file's w is \[4, 5\], this layer's is \[6, 4\]"):
        layer.load_own_variables({"0": np.zeros([4, 5], np.int8), "1": np.ones(6, np.float32),
                                  "2": np.ones(6, np.float32)})


def test_int8_output_layer():
    """The logits read the int8 copy of the output weight (wte, or out_head untied), a scale per
    row: exactly as NumPy's int8 product of h's quantized rows, and under XLA (one row) one s8 dot
    to the vocabulary; a `.keras` config names it, so that loading builds it."""
    import re

    import keras
    import tensorflow as tf
    from tfgpt2 import GPT2
    from tfgpt2.hparams import default_hparams
    from tfgpt2.products import cpus_only
    hp = default_hparams().override_from_dict(TINY)
    for tied in (True, False):
        model = GPT2(hp, tie_embeddings=tied)
        model.quantize("int8")
        w = model.wte if tied else model.out_head
        assert (model.logits_int8.path, model.logits_int8.dtype) == (f"{w.path}_int8", "int8")
        np.testing.assert_array_equal(model.logits_int8.numpy(), np.round(w.numpy() * model.logits_scale.numpy()[:, None]))
        assert keras.dtype_policies.deserialize(model.get_config()["dtype"])[w.path].quantization_mode == "int8"
        assert GPT2.from_config(model.get_config()).logits_int8.dtype == "int8"
    h = tf.constant(np.random.default_rng(0).normal(0, 1, [3, hp.n_embd]), tf.float32)
    h_int8 = np.round(h.numpy() * (127 / np.abs(h.numpy()).max(-1, keepdims=True)))
    expected = (h_int8 @ model.logits_int8.numpy().astype(np.float64).T) / (
        (127 / np.abs(h.numpy()).max(-1, keepdims=True)) * model.logits_scale.numpy())
    np.testing.assert_allclose(model.int8_logits(h).numpy(), expected, rtol=1e-6, atol=0)
    if not cpus_only():
        pytest.skip("the dot checked is XLA's CPU backend's")
    hlo = tf.function(lambda h: model.lm_logits(h), jit_compile=True).experimental_get_compiler_ir(h[None, :1])(stage="optimized_hlo")
    assert re.findall(r"= (\w+)\[2,(\d+)\]\S* dot\(", hlo) == [("s32", str(hp.n_vocab))], hlo


@pytest.mark.slow
def test_quantized_model_exports_and_refuses_checkpoints(tiny_01_dir, tmp_path):
    """The SavedModel of a quantized model computes the model's logits; a LiteRT export and an
    OpenAI checkpoint of it are refused, naming a quantized layer and an int8 weight."""
    import tensorflow as tf
    from tfgpt2 import export_litert, export_saved_model, load_model, save_model
    model = load_model(tiny_01_dir)
    model.quantize("int8")
    path = export_saved_model(model, str(tmp_path / "export"))
    logits = tf.saved_model.load(path).signatures["serving_default"](input_ids=tf.constant(IDS))["logits"]
    np.testing.assert_allclose(logits.numpy(), model(IDS)["logits"].numpy(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"LiteRT export takes a float32 model .* quantized layers \['model/h0"):
        export_litert(model, str(tmp_path / "q.tflite"))
    with pytest.raises(ValueError, match=r"cannot be saved as an OpenAI checkpoint \(model/wte_int8 is int8\)"):
        save_model(model, str(tmp_path / "ckpt"))


def test_lora_and_int8_refuse_each_other():
    """A layer with adapters is not quantized (its adapters would be dropped), nor are adapters
    added to an int8 layer (its call has no adapter term): both say so."""
    from tfgpt2 import GPT2
    from tfgpt2.hparams import default_hparams
    lora = GPT2(default_hparams().override_from_dict(TINY))
    lora.enable_lora(2)
    with pytest.raises(ValueError, match="a layer with LoRA adapters cannot be quantized"):
        lora.quantize("int8")
    quantized = GPT2(default_hparams().override_from_dict(TINY))
    quantized.quantize("int8")
    trainable = [v.path for v in quantized.trainable_weights]
    with pytest.raises(ValueError, match=r"LoRA on a quantized layer is not supported \(h0/attn/c_attn is quantized\)"):
        quantized.enable_lora(2)
    assert [v.path for v in quantized.trainable_weights] == trainable and trainable, \
        "a refused enable_lora changed which weights train"
    assert not quantized.lora_targets


def test_one_row_int8_product_multiplies_int8():
    """A one-row int8 product is exact (int32, as the int8 values' own product), and XLA's CPU
    backend compiles it on int8 operands: a one-row product alone gets its operands widened to
    int32, four times the weight's bytes read at every decoding step."""
    import re

    import tensorflow as tf
    from tfgpt2.adapters.int8 import int8_matmul
    from tfgpt2.products import cpus_only
    rng = np.random.default_rng(0)
    x, w = (tf.constant(rng.integers(-127, 128, shape), tf.int8) for shape in ([1, 64], [64, 48]))
    product = tf.function(lambda x, w: int8_matmul(x, w), jit_compile=True, autograph=False)
    np.testing.assert_array_equal(product(x, w).numpy(), x.numpy().astype(np.int32) @ w.numpy().astype(np.int32))
    if not cpus_only():
        pytest.skip("the operand types checked are XLA's CPU backend's")
    hlo = product.experimental_get_compiler_ir(x, w)(stage="optimized_hlo")
    types = dict(re.findall(r"%([\w.-]+) = (\w+)\[", hlo))
    dots = [(out, types[a], types[b]) for out, a, b in re.findall(r"= (\w+)\[\S* dot\(%([\w.-]+), %([\w.-]+)\)", hlo)]
    assert dots == [("s32", "s8", "s8")], hlo
