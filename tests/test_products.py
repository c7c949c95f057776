"""tfgpt2/products.py: every float32 product of the model, of generation, of training and of an
exported SavedModel is XLA's dot at precision HIGHEST (full float32 on any device, whatever
TensorFlow's TensorFloat-32 setting), and `tf.matmul` only where `tf32=True` asks for it.

The precision is read from the traced graphs (a CPU shows it as well as a GPU); the numbers on
a GPU are checked by the tests marked `gpu`.
"""
import numpy as np
import pytest
import tensorflow as tf
import keras

import tfgpt2
from tfgpt2.formats import checkpoint
from tfgpt2.formats.saved_model import Serving
from tfgpt2.hparams import default_hparams
from tfgpt2.model import GPT2
from tfgpt2.products import matmul
from tfgpt2.train.step import Trainer

from tests.helpers import TINY, products

@pytest.mark.parametrize("transpose_a, transpose_b, batch", [
    (False, False, []), (False, True, []), (True, False, []), (True, True, []), (False, True, [2, 3])])
def test_matmul_is_the_product_and_its_gradient_tf_matmuls(transpose_a, transpose_b, batch):
    """op(a) @ op(b) and its gradients (written out: XLA's dot has none registered) against
    NumPy's in float64, traced (XLA's dot) and under XLA. (Not against `tf.matmul`'s: on a GPU
    that is TensorFloat-32 by default, 1e-3 off.)"""
    rng = np.random.default_rng(0)
    a = rng.normal(size=batch + ([7, 5] if transpose_a else [5, 7])).astype(np.float32)
    b = rng.normal(size=batch + ([3, 7] if transpose_b else [7, 3])).astype(np.float32)

    def run(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
            loss = tf.reduce_sum(tf.sin(y))
        return y, tape.gradient(loss, [a, b])
    swap = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    op_a, op_b = (swap(a) if transpose_a else a).astype(np.float64), swap(b) if transpose_b else b
    expected = np.matmul(op_a, op_b)
    dy = np.cos(expected)  # d sum(sin(y)) / dy
    grad_op_a, grad_op_b = np.matmul(dy, swap(op_b)), np.matmul(swap(op_a), dy)
    expected_grads = [swap(grad_op_a) if transpose_a else grad_op_a, swap(grad_op_b) if transpose_b else grad_op_b]
    for jit in (False, True):
        y, grads = tf.function(run, jit_compile=jit)(tf.constant(a), tf.constant(b))
        np.testing.assert_allclose(y.numpy(), expected, atol=1e-5, rtol=1e-5)
        for g, e in zip(grads, expected_grads):
            np.testing.assert_allclose(g.numpy(), e, atol=1e-5, rtol=1e-5)


def test_which_product_runs():
    """XLA's dot at HIGHEST for float32 in a graph; `tf.matmul` with tf32, in 16 bits, and
    eagerly where TensorFlow sees only CPUs (the same numbers there)."""
    def traced(dtype, tf32):
        spec = tf.TensorSpec([4, 4], dtype)
        fn = tf.function(lambda a, b: matmul(a, b, tf32=tf32))
        return products(fn.get_concrete_function(spec, spec).graph.as_graph_def())
    assert traced(tf.float32, False) == {"HIGHEST": 1}
    assert traced(tf.float32, True) == {"tf.matmul": 1}
    assert traced(tf.bfloat16, False) == {}  # a bfloat16 MatMul
    if all(d.device_type == "CPU" for d in tf.config.list_logical_devices()):
        a = tf.constant(np.random.default_rng(0).normal(size=[64, 64]), tf.float32)
        np.testing.assert_array_equal(matmul(a, a).numpy(), tf.matmul(a, a).numpy())


def forward_products(model):
    ids = tf.TensorSpec([None, None], tf.int32)
    return products(tf.function(lambda X: model(X)["logits"]).get_concrete_function(ids).graph.as_graph_def())


@pytest.mark.slow
def test_every_product_of_the_model_and_a_training_step(tiny_dir):
    """The forward pass with LoRA adapters and a training step (forward, gradients, update):
    every float32 product is XLA's dot at HIGHEST (test_export checks an exported SavedModel's:
    its logits and its generation loops)."""
    model = tfgpt2.load_model(tiny_dir)
    model.enable_lora(2, ["c_attn", "c_fc"])
    per_layer = 4 + 2 + 2 * 2  # Conv1D's, attention's, the adapters'
    assert forward_products(model) == {"HIGHEST": per_layer * TINY["n_layer"] + 1}
    step = Trainer(model, keras.optimizers.Adam(1e-3))._step.get_concrete_function(tf.TensorSpec([2, 9], tf.int32))
    assert list(products(step.graph.as_graph_def())) == ["HIGHEST"]


@pytest.mark.slow
def test_tf32_is_kept_by_the_model_and_asked_by_the_commands(tiny_dir, tmp_path, monkeypatch, signals):
    """`tf32=True` makes every product `tf.matmul`, in the SavedModel's signatures too, and is
    kept in get_config (and so in .keras files); --tf32 loads the model with it in every command
    that runs one (and on each worker of generate-batch --engine beam)."""
    hparams = default_hparams().override_from_dict(TINY)
    model = GPT2(hparams, tf32=True)
    model.enable_lora(2, ["c_attn", "c_fc"])
    assert forward_products(model) == {"tf.matmul": (4 + 2 + 2 * 2) * TINY["n_layer"] + 1}
    serving = Serving(model)
    for signature in (serving.logits, serving.generate):
        assert list(products(signature.get_concrete_function().graph.as_graph_def())) == ["tf.matmul"]
    assert GPT2.from_config(model.get_config()).tf32 is True
    assert GPT2.from_config(GPT2(hparams).get_config()).tf32 is False

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded(kwargs)
    dataset, prompts = tmp_path / "text.txt", tmp_path / "prompts.jsonl"
    dataset.write_text("Some text to read. " * 40)
    prompts.write_text('{"prompt": "Some text"}\n')
    flags = ["--model_dir", tiny_dir, "--tf32"]
    commands = {"generate": flags, "interactive": flags, "serve": flags,
                "generate-batch": flags + ["--input", str(prompts), "--output", str(tmp_path / "out.jsonl")],
                "evaluate": flags + ["--dataset", str(dataset)], "export": flags + [str(tmp_path / "e")],
                "train": ["--dataset", str(dataset), "--model_name", tiny_dir.rsplit("/", 1)[1], "--models_dir",
                          tiny_dir.rsplit("/", 1)[0], "--tf32", "--checkpoint_dir", str(tmp_path / "c")]}
    from tfgpt2.cli.main import main
    from tfgpt2.train import loop
    monkeypatch.setattr(checkpoint, "load_model", load_model)
    monkeypatch.setattr(loop, "load_model", load_model)
    for command, argv in commands.items():
        with pytest.raises(Loaded) as loaded:
            main([command, *argv])
        assert loaded.value.args[0]["tf32"] is True, command
    from tfgpt2.bulk.handlers import GPT2ModelHandler  # generate-batch --engine beam, on each worker
    with pytest.raises(Loaded) as loaded:
        GPT2ModelHandler(tiny_dir, {}, length=1, batch_size=1, tf32=True).load_model()
    assert loaded.value.args[0]["tf32"] is True


@pytest.mark.gpu
def test_float32_logits_on_the_gpu_are_the_cpus(gpt2_124m):
    """With TensorFlow's settings at their defaults (TensorFloat-32 on), float32 logits on the
    GPU, eager and under XLA, within 5e-4 of the CPU's; with tf32 they may differ more."""
    assert tf.config.experimental.tensor_float_32_execution_enabled()
    X = tf.constant(np.random.default_rng(0).integers(0, 50257, [2, 64]), tf.int32)
    logits = tf.function(lambda X: gpt2_124m(X)["logits"], jit_compile=True)
    with tf.device("/CPU:0"):
        expected = gpt2_124m(X)["logits"].numpy()
    with tf.device("/GPU:0"):
        eager, compiled = gpt2_124m(X)["logits"].numpy(), logits(X).numpy()
    assert np.abs(eager - expected).max() <= 5e-4
    assert np.abs(compiled - expected).max() <= 5e-4
