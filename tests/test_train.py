"""Fine-tuning against OpenAI's graph: the forks' loss and `tf.gradients`, TF1's AdamOptimizer,
run folders that OpenAI's code restores, accumulation, resume, and bad input."""
import dataclasses
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfgpt2
from tfgpt2.cli import train as train_cli
from tfgpt2.train.losses import token_losses, window_loss
from tfgpt2.train import data, loop, optimizers, run_folder
from tfgpt2.train.optimizers import make_optimizer
from tfgpt2.train.step import Trainer
from tfgpt2.testing.reference import Reference

from tests.helpers import (ROOT, SAMPLE_LENGTH, execute_notebook, ids_npz, random_ids, require_reference, run,
                           run_interrupted, weights_of)

# compiled training steps and the reference, in a process of its own (tests/own_process.py)
pytestmark = [pytest.mark.slow, pytest.mark.own_process]

@pytest.fixture
def ref(reference_tiny):
    """OpenAI's code on `tiny_dir`: the worker's one reference process (conftest), not one more."""
    return reference_tiny


def draws(chunks, seed, steps, per_step):
    """The windows a run with --seed draws for steps 1..steps."""
    windows = data.Windows(chunks, SAMPLE_LENGTH + 1)
    return np.stack([windows.take(windows.draw(seed, step, per_step)).numpy() for step in range(1, steps + 1)])


@pytest.mark.parametrize("xla", [False, True], ids=["tf.function", "XLA"])
def test_token_losses_are_tensorflows_cross_entropy_and_nan_for_a_bad_label(xla):
    """Values and gradients against `tf.nn.sparse_softmax_cross_entropy_with_logits` (logits of
    std 3, the real vocabulary size), and NaN, not a clamped label's loss, out of range."""
    rng = np.random.default_rng(0)
    logits = tf.constant(rng.normal(size=[2, 7, 50257]).astype(np.float32) * 3)
    labels = tf.constant(rng.integers(0, 50257, size=[2, 7]), tf.int32)

    def both(loss):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            value = tf.reduce_mean(loss(labels, logits))
        return value, tape.gradient(value, logits)
    ours = tf.function(lambda: both(token_losses), jit_compile=xla)()
    theirs = both(lambda y, x: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=x))
    assert abs(float(ours[0]) - float(theirs[0])) <= 1e-5 * float(theirs[0])
    assert float(tf.reduce_max(tf.abs(ours[1] - theirs[1]))) <= 1e-6 * float(tf.reduce_max(tf.abs(theirs[1])))
    bad = tf.constant([[5, 50257, -1]], tf.int32)
    losses = tf.function(token_losses, jit_compile=xla)(bad, logits[:1, :3]).numpy()
    assert np.isfinite(losses[0, 0]) and np.isnan(losses[0, 1:]).all(), losses


def test_token_losses_gradient_outside_xla_is_one_xla_program():
    """Outside XLA the loss's backward pass is `token_losses_grad`, one XLA program: no scatter
    of the label's logit into a zeroed [positions, n_vocab] tensor (autodiff's gradient of the
    gather, 80 ms of a 4 x 128 step) and no softmax of TensorFlow's own ops."""
    logits = tf.zeros([2, 3, 50257])

    def gradient(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf.reduce_mean(token_losses(tf.constant([[1, 2, 3], [4, 5, 6]]), logits))
        return tape.gradient(loss, logits)
    ops = tf.function(gradient).get_concrete_function(logits).graph.get_operations()
    types = {op.type for op in ops}
    assert not types & {"UnsortedSegmentSum", "Exp", "OneHot"}, types
    compiled = [op for op in ops if op.type.endswith("PartitionedCall") and op.get_attr("f").name.startswith(
        "__inference_token_losses_grad")]
    assert len(compiled) == 1


def test_fit_with_a_plain_keras_loss(tiny_dir):
    model = tfgpt2.load_model(tiny_dir)
    windows = data.Windows([random_ids(200)], SAMPLE_LENGTH + 1)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = windows.take(tf.constant([[0, 7]], tf.int64))[0]
    before = model.evaluate(batch[:, :-1], batch[:, 1:], verbose=0)
    np.testing.assert_allclose(before, float(window_loss(model, batch)), rtol=1e-5)
    history = model.fit(data.keras_dataset(windows, batch_size=2, seed=0), steps_per_epoch=3, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert model.evaluate(batch[:, :-1], batch[:, 1:], verbose=0) < before


def _check_sgd_step(model_dir, tmp_path, ref):
    window = random_ids(SAMPLE_LENGTH + 1, seed=3)
    history = run(model_dir, tmp_path, "--dataset", ids_npz(tmp_path / "one.npz", window),
                  "--optimizer", "sgd", "--learning_rate", "1", "--steps", "1")
    expected = ref.gradients(window[None])
    before, after = weights_of(model_dir), weights_of(tmp_path / "checkpoint" / "run1")
    assert set(after) == set(expected["gradients"])
    np.testing.assert_allclose(history[0][1], expected["loss"], rtol=1e-5)
    for name, grad in expected["gradients"].items():
        assert np.abs(grad).max() > 0, name
        error = np.abs((after[name] - before[name]) + grad).max() / np.abs(grad).max()
        assert error <= 1e-3, f"{name}: relative error {error:.2e}"


def test_sgd_step_is_minus_the_reference_gradient(tiny_dir, tmp_path, ref):
    _check_sgd_step(tiny_dir, tmp_path, ref)


def test_sgd_step_is_minus_the_reference_gradient_124m(gpt2_124m_dir, tmp_path, reference_124m):
    _check_sgd_step(gpt2_124m_dir, tmp_path, reference_124m)


def test_adam_is_tf1_adam_and_the_run_folder_restores_in_the_reference(tiny_dir, tmp_path, ref):
    chunks = [random_ids(40, seed=4), random_ids(25, seed=5)]
    # The forks' learning rate, 2e-5: Adam turns gradients that are zero but for rounding (the
    # key biases': softmax ignores them) into steps of up to lr, whatever the implementation.
    history = run(tiny_dir, tmp_path, "--dataset", ids_npz(tmp_path / "d.npz", *chunks), "--batch_size", "2",
                  "--steps", "3", "--seed", "7")
    expected = ref.adam_steps(draws(chunks, 7, 3, 2), 2e-5)
    np.testing.assert_allclose([loss for _, loss in history], expected["losses"], rtol=1e-5)
    before, after = weights_of(tiny_dir), weights_of(tmp_path / "checkpoint" / "run1")
    for name, value in expected["weights"].items():
        assert np.abs(value - before[name]).max() >= 5e-5, name  # 3 steps of about lr each
        error = np.abs(after[name] - value).max()
        assert error <= 1e-5, f"{name}: max abs difference {error:.2e}"

    run_dir = str(tmp_path / "checkpoint" / "run1")
    tokens = random_ids(2 * 20, seed=6).reshape(2, 20)
    with Reference(require_reference(), run_dir) as run_ref:
        theirs = run_ref.model(tokens)["logits"]
    ours = tfgpt2.load_model(run_dir)(tokens)["logits"].numpy()
    assert np.abs(ours - theirs).max() <= 5e-4


def test_accumulation_loops_over_micro_batches_into_one_set_of_sums(micro_dir):
    """Without accumulation the step has no loop (XLA keeps even one that never runs, and the
    gradients it carried fused neither with their producers nor into Adam's update: 124M at
    4 x 128 tokens, 0.4 GB more peak memory); with it, the loop adds each micro-batch's
    gradients to one set of variables and carries only scalars and the tokens (carried sums
    held 3.5 sets of gradients more, not 1.3). The peaks are figures of
    `tools/benchmark_memory.py`; the graph is what this test reads."""
    tokens = tf.constant(random_ids(4 * 9).reshape(4, 9), tf.int32)
    for accumulate in (1, 2):
        trainer = Trainer(tfgpt2.load_model(micro_dir), make_optimizer("adam", 1e-3), accumulate=accumulate,
                          jit_compile=False)
        graph = trainer._gradients.get_concrete_function(tokens).graph
        loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
        assert len(loops) == accumulate - 1
        if accumulate == 1:
            assert trainer._sums == []
            continue
        assert [v.shape for v in trainer._sums] == [v.shape for v in trainer.variables]
        carried = [t for t in loops[0].inputs if t.dtype != tf.resource]
        assert all(t.shape.rank == 0 or t.dtype == tf.int32 for t in carried), carried
        shapes = {tuple(v.shape) for v in trainer.variables}
        made = {op.type for op in graph.get_operations() for t in op.outputs
                if t.dtype == tf.float32 and tuple(t.shape.as_list()) in shapes}
        assert made == {"ReadVariableOp", "Identity"}, made  # the sums read after the loop, no zeros before it


def optimizer_case():
    """Weights of a vector's, a matrix's and a Conv1D's shape: (shapes, 3 steps of gradients,
    starting values)."""
    rng = np.random.default_rng(0)
    shapes = [[7], [5, 6], [1, 4, 9]]
    grads = [[tf.constant(rng.normal(size=s), tf.float32) for s in shapes] for _ in range(3)]
    return shapes, grads, [rng.normal(size=s).astype(np.float32) for s in shapes]


def test_adafactor_updates_as_keras_without_full_size_state():
    """tfgpt2's Adafactor against Keras': the same weights after 3 updates (a learning rate
    above and below 1/sqrt(step)), with state of rows + columns for a matrix, not one per weight."""
    shapes, grads, start = optimizer_case()
    for options in ({"learning_rate": 1.0}, {"learning_rate": 1e-2}):
        results = []
        for cls in (optimizers.Adafactor, keras.optimizers.Adafactor):
            weights = [keras.Variable(w) for w in start]
            optimizer = cls(**options)
            optimizer.build(weights)
            for step in grads:
                optimizer.apply_gradients(zip(step, weights))
            results.append(([w.numpy() for w in weights], sum(int(np.prod(v.shape)) for v in optimizer.variables)))
        (ours, our_state), (keras_, keras_state) = results
        for a, b, w in zip(ours, keras_, start):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
            assert np.abs(a - w).max() > 1e-4  # it moved
        assert our_state == keras_state - 5 * 6 - 4 * 9 - 2  # less the velocities and two scalar placeholders


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_updates_as_keras_with_one_kernel_per_weight(name):
    """tfgpt2's Adam and AdamW (`make_optimizer`) against Keras': the same weights after 3
    updates, and each weight updated by one `ResourceApplyAdam` (Keras' ops made weight-sized
    temporaries)."""
    shapes, grads, start = optimizer_case()
    keras_optimizer = dict(adam=keras.optimizers.Adam, adamw=keras.optimizers.AdamW)[name]
    results = []
    for make in (lambda: make_optimizer(name, 1e-2, weight_decay=0.1 if name == "adamw" else 0.0),
                 lambda: keras_optimizer(1e-2, beta_1=0.9, beta_2=0.999, epsilon=1e-8,
                                         **(dict(weight_decay=0.1) if name == "adamw" else {}))):
        weights = [keras.Variable(w) for w in start]
        optimizer = make()
        optimizer.build(weights)
        update = tf.function(lambda g: optimizer.apply_gradients(zip(g, weights)))
        for g in grads:
            update(g)
        kernels = [op.type for op in update.get_concrete_function(grads[0]).graph.get_operations()]
        results.append(([w.numpy() for w in weights], kernels.count("ResourceApplyAdam")))
    (ours, our_kernels), (keras_, keras_kernels) = results
    for a, b, w in zip(ours, keras_, start):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # rounding: weights up to 3.1, ulp 2.4e-7
        assert np.abs(a - w).max() > 1e-3  # it moved
    assert (our_kernels, keras_kernels) == (len(shapes), 0)


@pytest.mark.parametrize("xla", [(), ("--no_xla",)], ids=["xla", "no_xla"])
def test_accumulating_4_x_1_equals_a_batch_of_4(micro_dir, tmp_path, xla):
    dataset = ids_npz(tmp_path / "d.npz", random_ids(60, seed=8))
    flags = ("--dataset", dataset, "--optimizer", "sgd", "--learning_rate", "1", "--steps", "1", *xla)
    whole = run(micro_dir, tmp_path, *flags, "--batch_size", "4", run_name="whole")
    parts = run(micro_dir, tmp_path, *flags, "--accumulate_gradients", "4", run_name="parts")
    np.testing.assert_allclose(whole[0][1], parts[0][1], rtol=1e-6)
    before = weights_of(micro_dir)
    a, b = weights_of(tmp_path / "checkpoint" / "whole"), weights_of(tmp_path / "checkpoint" / "parts")
    for name in before:
        step = np.abs(a[name] - before[name]).max()
        assert np.abs(a[name] - b[name]).max() <= 1e-4 * step, name


def test_a_run_stopped_and_resumed_equals_an_uninterrupted_one(micro_dir, tmp_path, monkeypatch):
    flags = ("--dataset", ids_npz(tmp_path / "d.npz", random_ids(300, seed=9)), "--batch_size", "2",
             "--accumulate_gradients", "2", "--learning_rate", "1e-3", "--steps", "6", "--lr_schedule", "cosine",
             "--warmup_steps", "2", "--clip_norm", "1", "--weight_decay", "0.1", "--optimizer", "adamw",
             "--save_every", "2", "--max_checkpoints", "2", "--val_every", "3", "--val_batch_count", "2",
             "--val_fraction", "0.3", "--noise", "0.1", "--no_xla")  # the reference tests above run the XLA step
    whole = run(micro_dir, tmp_path, *flags, "--sample_every", "3", "--sample_num", "2", run_name="whole")

    first = run_interrupted(monkeypatch, 5, micro_dir, tmp_path, *flags, run_name="resumed")
    run_dir = tmp_path / "checkpoint" / "resumed"
    assert [s for s, _ in first] == [1, 2, 3, 4]
    assert open(run_dir / "counter").read() == "4\n"
    second = run(micro_dir, tmp_path, *flags, run_name="resumed")
    assert first + second == whole
    a, b = weights_of(tmp_path / "checkpoint" / "whole"), weights_of(run_dir)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

    run_dir = tmp_path / "checkpoint" / "whole"
    assert run_folder.checkpoint_steps(str(run_dir))[-2:] == [4, 6]
    best = run_folder.read_best(str(run_dir))
    assert best["step"] in (3, 6) and best["step"] in run_folder.checkpoint_steps(str(run_dir))
    names = sorted(os.listdir(run_dir))
    assert [n for n in names if n.startswith("optimizer-")] == ["optimizer-6.data-00000-of-00001", "optimizer-6.index"]
    assert {"counter", "hparams.json", "encoder.json", "vocab.bpe"} <= set(names)
    assert (run_dir / "samples-6.txt").read_text().count("SAMPLE") == 2
    events = [n for n in names if n.startswith("events.out.tfevents")]
    tags = {value.tag for event in tf.compat.v1.train.summary_iterator(str(run_dir / events[0]))
            for value in event.summary.value}
    assert {"loss", "learning_rate", "tokens_per_second", "val_loss", "val_perplexity"} <= tags
    assert not [n for n in names if n.startswith(".tmp") or n.endswith(".tmp")]
    tfgpt2.load_model(str(run_dir))


def test_an_adafactor_run_resumes_exactly(micro_dir, tmp_path, monkeypatch):
    """tfgpt2's Adafactor keeps other state than Keras' (rows and columns): saved and restored
    with the run folder all the same."""
    flags = ("--dataset", ids_npz(tmp_path / "d.npz", random_ids(300, seed=3)), "--batch_size", "2",
             "--learning_rate", "1e-2", "--steps", "4", "--optimizer", "adafactor", "--save_every", "2",
             "--no_xla")
    whole = run(micro_dir, tmp_path, *flags, run_name="whole")
    first = run_interrupted(monkeypatch, 3, micro_dir, tmp_path, *flags, run_name="resumed")
    second = run(micro_dir, tmp_path, *flags, run_name="resumed")
    assert [s for s, _ in first] == [1, 2] and first + second == whole
    a, b = weights_of(tmp_path / "checkpoint" / "whole"), weights_of(tmp_path / "checkpoint" / "resumed")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_only_train_transformer_layers_leaves_embeddings_unchanged(micro_dir, tmp_path):
    """Also: Adafactor, and --restore_from a model folder."""
    run(micro_dir, tmp_path, "--dataset", ids_npz(tmp_path / "d.npz", random_ids(40)), "--steps", "2",
        "--learning_rate", "1e-2", "--only_train_transformer_layers", "--no_xla", "--optimizer", "adafactor",
        "--model_name", "elsewhere", "--restore_from", micro_dir)
    assert (tmp_path / "checkpoint" / "run1" / "vocab.bpe").read_bytes() == open(f"{micro_dir}/vocab.bpe", "rb").read()
    before, after = weights_of(micro_dir), weights_of(tmp_path / "checkpoint" / "run1")
    for name in ("model/wte", "model/wpe", "model/ln_f/g", "model/ln_f/b"):
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    assert np.abs(before["model/h0/attn/c_attn/w"] - after["model/h0/attn/c_attn/w"]).max() > 1e-3


def test_a_tiny_model_memorizes_a_short_text(micro_dir, tmp_path):
    text = tmp_path / "poem.txt"
    text.write_text("Tyger Tyger, burning bright, In the forests of the night; "
                    "What immortal hand or eye, Could frame thy fearful symmetry?")
    history = run(micro_dir, tmp_path, "--dataset", str(text), "--steps", "60", "--batch_size", "4",
                  "--learning_rate", "1e-2", "--no_xla")
    assert np.mean([loss for _, loss in history[-5:]]) < 0.5, history[-5:]


@pytest.mark.parametrize("flags", [["--precision", "mixed_bfloat16"], ["--precision", "mixed_float16", "--remat"]],
                         ids=["mixed_bfloat16", "mixed_float16-remat"])
def test_mixed_precision_memorizes_a_short_text_as_float32(micro_dir, tmp_path, flags):
    """As the float32 test above; float16 with dynamic loss scaling never diverges."""
    text = tmp_path / "poem.txt"
    text.write_text("Tyger Tyger, burning bright, In the forests of the night; "
                    "What immortal hand or eye, Could frame thy fearful symmetry?")
    history = run(micro_dir, tmp_path, "--dataset", str(text), "--steps", "60", "--batch_size", "4",
                  "--learning_rate", "1e-2", "--no_xla", *flags)
    assert all(np.isfinite(loss) for _, loss in history), history
    assert np.mean([loss for _, loss in history[-5:]]) < 0.5, history[-5:]
    weights = weights_of(str(tmp_path / "checkpoint" / "run1"))
    assert {w.dtype for w in weights.values()} == {np.dtype(np.float32)}  # the original layout


# ---- bad input ----------------------------------------------------------------------------

def _fails(capsys, tiny_dir, tmp_path, message, *flags):
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--models_dir", os.path.dirname(tiny_dir), "--model_name", os.path.basename(tiny_dir),
                    "--checkpoint_dir", str(tmp_path / "checkpoint"), "--sample_every", "0",
                    "--print_every", "0", "--sample_length", str(SAMPLE_LENGTH), *flags])
    error = str(e.value.code) if isinstance(e.value.code, str) else capsys.readouterr().err
    assert message in error, error
    assert not (tmp_path / "checkpoint" / "run1" / "checkpoint").exists()


def test_bad_data_is_a_clear_error(tiny_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(capsys, tiny_dir, tmp_path, "a training window needs 17 tokens", "--dataset", str(empty))
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.")
    _fails(capsys, tiny_dir, tmp_path, "6 tokens in 1 chunks, the longest 6; a training window needs 17", "--dataset", str(short))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café ".encode("latin-1") * 40)
    _fails(capsys, tiny_dir, tmp_path, "latin.txt: not valid utf-8 at byte 3", "--dataset", str(latin))
    bad_ids = ids_npz(tmp_path / "bad.npz", random_ids(30), [1, 2, 50257, 3])
    _fails(capsys, tiny_dir, tmp_path, "bad.npz: arr_1[2] is token id 50257, outside [0, n_vocab=50257)",
           "--dataset", bad_ids)
    _fails(capsys, tiny_dir, tmp_path, "no such file", "--dataset", str(tmp_path / "missing.txt"))
    whole = open(bad_ids, "rb").read()
    (tmp_path / "cut.npz").write_bytes(whole[:len(whole) // 2])  # a copy that stopped half way
    _fails(capsys, tiny_dir, tmp_path, "cut.npz: not a readable .npz file (BadZipFile", "--dataset",
           str(tmp_path / "cut.npz"))
    os.chmod(short, 0)
    if not os.access(short, os.R_OK):  # root reads anything
        _fails(capsys, tiny_dir, tmp_path, "short.txt: cannot read", "--dataset", str(short))


def test_bad_flags_and_folders_are_clear_errors(tiny_dir, tmp_path, capsys):
    dataset = ids_npz(tmp_path / "d.npz", random_ids(40))
    _fails(capsys, tiny_dir, tmp_path, "--batch_size must be an integer >= 1, got '0'", "--dataset", dataset,
           "--batch_size", "0")
    _fails(capsys, tiny_dir, tmp_path, "invalid choice: 'adagrad'", "--dataset", dataset, "--optimizer", "adagrad")
    _fails(capsys, tiny_dir, tmp_path, "--lr_schedule cosine needs --steps", "--dataset", dataset,
           "--lr_schedule", "cosine")
    _fails(capsys, tiny_dir, tmp_path, "--sample_length 65 exceeds the model's context n_ctx=64",
           "--dataset", dataset, "--sample_length", "65")
    _fails(capsys, tiny_dir, tmp_path, "--restore_from nowhere: no such folder", "--dataset", dataset,
           "--restore_from", "nowhere")

    run_dir = tmp_path / "checkpoint" / "run1"  # a run folder at step 1, written by hand
    run_folder.write_run_files(str(run_dir), tfgpt2.load_hparams(tiny_dir), tiny_dir)
    for name in os.listdir(tiny_dir):
        if name.startswith("model.ckpt."):
            os.link(os.path.join(tiny_dir, name), run_dir / name.replace("model.ckpt", "model-1"))
    (run_dir / "checkpoint").write_text('model_checkpoint_path: "model-1"\n')
    saved = {name: (run_dir / name).read_bytes() for name in os.listdir(run_dir) if not name.startswith("events")}
    (run_dir / "hparams.json").write_text(saved["hparams.json"].decode().replace('"n_layer": 2', '"n_layer": 3'))
    resume = ["--checkpoint_dir", str(tmp_path / "checkpoint"), "--dataset", dataset, "--steps", "2",
              "--sample_length", str(SAMPLE_LENGTH)]
    with pytest.raises(tfgpt2.CheckpointError, match="missing variables: model/h2/attn/c_attn/b"):
        loop.train(train_cli.parse_config(resume))  # (given, --model_name tiny would be refused first)
    (run_dir / "hparams.json").write_bytes(saved["hparams.json"])
    for start in ("fresh", tiny_dir):  # either would start over and rotate the run's checkpoints away
        with pytest.raises(ValueError, match="already holds checkpoints"):
            run(tiny_dir, tmp_path, "--dataset", dataset, "--steps", "2", "--restore_from", start)
    # --steps is the run's total: below the run's step, an error, not a silent exit
    with pytest.raises(ValueError, match=r"run1 is at step 1, past --steps 0: --steps is the run's total"):
        run(tiny_dir, tmp_path, "--dataset", dataset, "--steps", "0")
    assert run(tiny_dir, tmp_path, "--dataset", dataset, "--steps", "1") == []  # done already
    assert saved == {name: (run_dir / name).read_bytes() for name in saved}


# ---- nothing lost ---------------------------------------------------------------------------

def cli_flags(micro_dir, tmp_path, dataset, *more):
    return ["--models_dir", os.path.dirname(micro_dir), "--model_name", os.path.basename(micro_dir),
            "--checkpoint_dir", str(tmp_path / "checkpoint"), "--dataset", dataset, "--sample_every", "0",
            "--print_every", "0", "--sample_length", str(SAMPLE_LENGTH), *more]


def folder_files(run_dir):
    """{name: bytes} of a run folder's files but its TensorBoard events and its lock."""
    return {name: (run_dir / name).read_bytes() for name in sorted(os.listdir(run_dir))
            if not name.startswith(("events.", ".lock"))}


def test_a_new_run_that_diverges_says_it_has_no_checkpoint(tmp_path):
    """The error of a run whose loss goes NaN before its first save (the test above: after one)
    says so, with no `None` for the checkpoint it lacks. Its step is a stand-in for `Trainer`'s
    (the loss it returns, its count of skipped updates): `Run.update` is what is tested."""
    class Diverging:
        skipped = tf.Variable(0)

        def step(self, batch):
            return tf.constant(float("nan"))
    config = loop.TrainConfig(dataset="-", checkpoint_dir=str(tmp_path), run_name="new")
    run = loop.Run(config, config.run_dir, None, None, Diverging(), None, None, None, base="")
    with pytest.raises(ValueError) as e:
        run.update(None, 1, [])
    assert str(e.value) == (f"{tmp_path / 'new'}: step 1: the loss is nan, not finite: the run stops, saving nothing "
                            "(it holds no checkpoint yet); try a lower --learning_rate, --clip_norm, or "
                            "--max_bad_steps to skip a few such updates")


def test_a_run_that_diverges_stops_with_its_last_checkpoint_intact(micro_dir, tmp_path, capsys):
    """Resuming a good run with --learning_rate 1e10: the loss goes NaN, and the run stops with
    an error naming the step, saving nothing (it saved model-6, deleted the good model-3 and
    exited 0). With --max_bad_steps 2 it skips two such updates first. Weights that are not
    finite are never written by save_run."""
    flags = cli_flags(micro_dir, tmp_path, ids_npz(tmp_path / "d.npz", random_ids(300)))
    train_cli.main(flags + ["--steps", "3"])
    run_dir = tmp_path / "checkpoint" / "run1"
    good = folder_files(run_dir)
    assert run_folder.checkpoint_steps(str(run_dir)) == [3]
    for more, skipped in ((), 0), (("--max_bad_steps", "2"), 2):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train_cli.main(flags + ["--steps", "20", "--learning_rate", "1e10", *more])
        assert re.fullmatch(r"error: \S+run1: step \d+: the loss is nan, not finite: the run stops, saving nothing "
                            r"\(its latest checkpoint: \S+run1/model-3\); try a lower --learning_rate, --clip_norm, "
                            r"or --max_bad_steps to skip a few such updates", e.value.code), e.value.code
        err = capsys.readouterr().err
        assert err.count("the update is skipped") == skipped
        assert folder_files(run_dir) == good
    model = tfgpt2.load_model(str(run_dir))
    model.wpe.assign(np.full(model.wpe.shape, np.nan, np.float32))
    with pytest.raises(ValueError, match=r"step 4's weights are not finite \(model/wpe holds NaN or inf\): not "
                                         r"saved, the run folder is as it was \(its latest checkpoint: \S+model-3\)"):
        run_folder.save_run(str(run_dir), model, make_optimizer("adam", 1e-3), 4)
    assert folder_files(run_dir) == good


def test_a_second_run_on_the_folder_is_refused_and_ctrl_c_saves_and_exits_130(micro_dir, tmp_path):
    """The same run started twice: the second is refused, naming the first (pid and host),
    whose checkpoints stay its own. Ctrl-C on the first saves, then exits with status 130 (0
    before: a script could not tell it from a finished run), its lock file removed. A lock file
    left by a process that is gone (killed: its lock ended with it) is taken over by the next
    run, which continues the first's checkpoint and removes it at its end."""
    flags = cli_flags(micro_dir, tmp_path, ids_npz(tmp_path / "d.npz", random_ids(300)), "--print_every", "1")
    with subprocess.Popen([sys.executable, "-m", "tfgpt2_cli", "train", *flags, "--steps", "100000"], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as first:
        err = ""
        while "[2] loss=" not in err:
            line = first.stderr.readline()
            assert line, err
            err += line
        with pytest.raises(SystemExit) as e:
            train_cli.main(flags + ["--steps", "100000"])
        assert re.fullmatch(rf"error: \S+run1 is in use by another training run \(pid {first.pid} on \S+, which holds "
                            r"\S+run1/.lock\): wait for it to end, or choose another --run_name", e.value.code)
        first.send_signal(signal.SIGINT)
        err += first.stderr.read()
        assert first.wait(timeout=300) == 130, err
    assert "interrupted" in err and "Traceback" not in err
    run_dir = tmp_path / "checkpoint" / "run1"
    step = int((run_dir / "counter").read_text())
    assert step >= 2 and run_folder.checkpoint_steps(str(run_dir)) == [step]
    assert not (run_dir / ".lock").exists()
    (run_dir / ".lock").write_text(f"pid {first.pid} on a machine\n")  # as a killed run leaves it, held by no one
    train_cli.main(flags + ["--steps", str(step + 1)])
    assert run_folder.checkpoint_steps(str(run_dir)) == [step + 1]
    assert not (run_dir / ".lock").exists()


def test_a_run_continues_only_from_the_model_it_started_from(micro_dir, tiny_dir, tmp_path):
    """`--model_name` given to a run started from another model is refused, naming both: from
    the record of the model a run started from, or, for a run folder without it (gpt-2-simple's),
    by its hparams. With its own --model_name (or none) the run continues."""
    dataset = ids_npz(tmp_path / "d.npz", random_ids(300))
    flags, other = cli_flags(micro_dir, tmp_path, dataset), cli_flags(tiny_dir, tmp_path, dataset)
    loop.train(train_cli.parse_config(flags + ["--steps", "1"]))
    with pytest.raises(ValueError, match=rf"run1 was started from {re.escape(micro_dir)}, not from --model_name tiny "
                                         rf"\({re.escape(tiny_dir)}\); leave --model_name out to continue it"):
        loop.train(train_cli.parse_config(other + ["--steps", "2"]))
    os.remove(tmp_path / "checkpoint" / "run1" / "base_model.json")
    with pytest.raises(ValueError, match=r"run1 was started from a model of hparams \{'n_vocab': 50257, 'n_ctx': 32, "
                                         r"'n_embd': 32, 'n_head': 2, 'n_layer': 1\}, not from --model_name tiny"):
        loop.train(train_cli.parse_config(other + ["--steps", "2"]))
    assert [s for s, _ in loop.train(train_cli.parse_config(flags + ["--steps", "2"]))] == [2]


def test_the_samples_take_the_forks_top_p(micro_dir, tmp_path):
    """--top_p > 0 samples by nucleus sampling, as the forks' (and then not by --top_k)."""
    from tfgpt2.train.config import TrainConfig
    model, enc = tfgpt2.load_model(micro_dir), tfgpt2.get_encoder("micro", os.path.dirname(micro_dir))
    config = TrainConfig(dataset="-", top_p=0.5, sample_length=SAMPLE_LENGTH, seed=3)
    text = loop.write_samples(model, enc, config, str(tmp_path), 1)
    row = tfgpt2.generate(model, [[enc.eot_token]], SAMPLE_LENGTH, top_k=0, top_p=0.5, seed=3 + 1)[0]
    assert text == (tmp_path / "samples-1.txt").read_text() == "=" * 20 + " SAMPLE 0 " + "=" * 20 + "\n" + \
        enc.decode(row[1:]) + "\n"
    assert loop.write_samples(model, enc, dataclasses.replace(config, top_p=0.0), str(tmp_path), 1) != text


def test_finetune_is_the_command_line_in_python(tiny_dir, tmp_path):
    """`tfgpt2.finetune(dataset, flag=value, switch=True)`: the same run as the flags, and a
    bad flag a ValueError (not argparse's exit) before any run folder is made."""
    dataset = ids_npz(tmp_path / "d.npz", random_ids(60))
    flags = dict(models_dir=os.path.dirname(tiny_dir), model_name=os.path.basename(tiny_dir),
                 checkpoint_dir=str(tmp_path / "checkpoint"), sample_every=0, save_every=0, print_every=0,
                 sample_length=SAMPLE_LENGTH, steps=3, no_xla=True, remat=False, val_dataset=None)
    history = tfgpt2.finetune(dataset, run_name="python", **flags)
    assert [s for s, _ in history] == [1, 2, 3]
    assert history == run(tiny_dir, tmp_path, "--dataset", dataset, "--steps", "3", "--no_xla", run_name="flags")
    assert run_folder.checkpoint_steps(str(tmp_path / "checkpoint" / "python")) == [3]
    for bad, message in [(dict(batch_size=0), "--batch_size must be an integer >= 1, got 0"),
                         (dict(optimiser="adam"), "unknown setting 'optimiser' (did you mean 'optimizer'?)"),
                         (dict(lr_schedule="cosine", steps=-1), "--lr_schedule cosine needs --steps")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            tfgpt2.finetune(dataset, run_name="bad", **{**flags, **bad})
    assert not (tmp_path / "checkpoint" / "bad").exists()


@pytest.mark.slow  # a notebook kernel, XLA compiles
def test_the_finetuning_notebook_runs(tiny_dir, tmp_path, monkeypatch):
    """notebooks/finetune.ipynb top to bottom on the tiny model, fine-tuned on the README: the
    held-out loss falls, and the second call continues the run."""
    settings = {"TFGPT2_MODEL_DIR": tiny_dir, "TFGPT2_WORK_DIR": str(tmp_path), "TFGPT2_STEPS": "40",
                "TFGPT2_LEARNING_RATE": "1e-3"}
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TFGPT2_DATASET", raising=False)
    stdout = execute_notebook(ROOT / "notebooks" / "finetune.ipynb")
    before, after = map(float, re.search(r"held-out loss: before ([\d.]+), after ([\d.]+)", stdout).groups())
    assert after < before - 1, stdout
    assert "continued at step 41 and stopped at 50" in stdout
    assert run_folder.checkpoint_steps(str(tmp_path / "checkpoint" / "run1"))[-1] == 50
