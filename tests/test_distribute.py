"""Fine-tuning under tf.distribute (`tfgpt2/train/distribute.py`, `python -m tfgpt2.train --strategy`)
on the tiny model (2 layers, n_embd 64) with windows of 17 tokens.

Each test compares the weights after a few updates (STEPS; the two workers', killed and
resumed, as many as they made) with those of one device on the same global batches. The
optimizer is SGD, whose update is linear in the gradient, so the weights differ only by float32
rounding of the gradient sums: max abs difference 2.1e-6 (mirrored) and 2.5e-6 (two workers)
measured, against weight changes up to 0.36; TOLERANCE is 2e-5. Adam would divide near-zero
gradient components by their own magnitude and turn that rounding into differences up to its
learning rate: the Adam runs (test_train's micro model) check the keys' bias, whose gradient is
such rounding, by the size of its move.
"""
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import ROOT, SAMPLE_LENGTH, free_ports, ids_npz, random_ids, tensors, weights_of
from tfgpt2.formats import lora
from tfgpt2.train import distribute, loop, run_folder
from tfgpt2.cli.train import parse_config
from tfgpt2.formats.checkpoint import load_model

pytestmark = pytest.mark.slow  # several TensorFlow processes

ENV = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
STEPS = 3
TOLERANCE = 2e-5
MIRRORED = """
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tfgpt2.cli.train import parse_config
from tfgpt2.train import distribute, loop
strategy = distribute.make_strategy("mirrored")
assert strategy.num_replicas_in_sync == 2, strategy.extended.worker_devices
for argv, mirrored in json.load(open(sys.argv[1])):
    try:
        result = loop.train(parse_config(argv), strategy if mirrored else None)
    except ValueError as e:
        result = f"error: {e}"
    print("result:", json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = "the a cat sat on mat of time every effort moves you language model tensor flow".split()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(" ".join(rng.choice(words, 3000)))
    return str(path)


def flags(tiny_dir, corpus, checkpoint_dir, *extra, steps=STEPS):
    models_dir, name = os.path.split(tiny_dir)
    return ["--dataset", corpus, "--models_dir", models_dir, "--model_name", name,
            "--checkpoint_dir", str(checkpoint_dir), "--run_name", "run", "--steps", str(steps),
            "--batch_size", "4", "--sample_length", "16", "--sample_every", "0", "--save_every", "1",
            "--optimizer", "sgd", "--learning_rate", "0.5", "--print_every", "1", *extra]


def weights(run_dir, step=None):
    """The run folder's weights: its latest checkpoint's, or `step`'s."""
    checkpoint = str(run_dir / f"model-{step}") if step else None
    return {v.path: v.numpy() for v in load_model(str(run_dir), checkpoint=checkpoint).weights}


def max_difference(a, b):
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.fixture(scope="module")
def one_device(tiny_dir, corpus, tmp_path_factory):
    """at(step): the weights after `step` updates on one device (in this process), from the run's
    checkpoint of that step; it keeps every step's, and goes on as far as asked."""
    checkpoints = tmp_path_factory.mktemp("one")

    def at(step):
        if not (checkpoints / "run" / f"model-{step}.index").exists():
            loop.train(parse_config(flags(tiny_dir, corpus, checkpoints, "--max_checkpoints", "1000", steps=step)))
        return weights(checkpoints / "run", step)
    assert max_difference(at(STEPS), weights(tiny_dir)) > 1e-3  # the steps changed the weights
    return at


def start_workers(args):
    """Two `python -m tfgpt2.train --strategy multiworker` processes on 127.0.0.1."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    return [subprocess.Popen([sys.executable, "-m", "tfgpt2.train", "--strategy", "multiworker", *args], cwd=ROOT,
                             env=dict(ENV, TF_CONFIG=json.dumps({"cluster": cluster,
                                                                 "task": {"type": "worker", "index": i}})),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]


def finish(children, timeout=300):
    return [(child.wait(timeout), *child.communicate()) for child in children]


def micro_flags(micro_dir, tmp_path, run_name, *extra):
    """Adam on the micro model, global batch 2, 2 steps, into `tmp_path/run_name`."""
    return ["--models_dir", os.path.dirname(micro_dir), "--model_name", "micro", "--checkpoint_dir", str(tmp_path),
            "--dataset", ids_npz(tmp_path / "d.npz", random_ids(100)), "--steps", "2", "--batch_size", "2",
            "--sample_every", "0", "--print_every", "0", "--sample_length", str(SAMPLE_LENGTH), "--run_name",
            run_name, *extra]


@pytest.fixture(scope="module")
def mirrored(tiny_dir, micro_dir, corpus, tmp_path_factory):
    """Runs of train() in one fresh process (devices are set before use) with two logical CPUs:
    {name: (its folder, its history or "error: ..." )}, each run under a MirroredStrategy over
    the two, or (the "single" ones) on one device."""
    tmp = tmp_path_factory.mktemp("mirrored")
    runs = {"sgd": (flags(tiny_dir, corpus, tmp / "sgd"), True),
            "batch 3": (flags(tiny_dir, corpus, tmp / "batch 3", "--batch_size", "3"), True)}
    adapters = ("--accumulate_gradients", "2", "--learning_rate", "1e-2", "--lora_rank", "2", "--no_xla")
    skipping = ("--learning_rate", "1e30", "--max_bad_steps", "5", "--steps", "3", "--save_every", "1",
                "--max_checkpoints", "3")
    for name, extra in [("adam", ()), ("adam accumulated", ("--accumulate_gradients", "2")), ("lora", adapters),
                        ("skipping", skipping)]:
        (tmp / name).mkdir()
        runs[name] = (micro_flags(micro_dir, tmp / name, "mirrored", *extra), True)
        runs[f"{name} single"] = (micro_flags(micro_dir, tmp / name, "single", *extra), False)
    (tmp / "runs.json").write_text(json.dumps(list(runs.values())))
    done = subprocess.run([sys.executable, "-c", MIRRORED, str(tmp / "runs.json")], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line[len("result: "):]) for line in done.stdout.splitlines()
               if line.startswith("result: ")]
    assert len(results) == len(runs), done.stdout
    return {name: (tmp / name, result) for name, result in zip(runs, results)}


def test_mirrored_over_two_logical_cpus_equals_one_device(mirrored, one_device):
    folder, history = mirrored["sgd"]
    assert [step for step, _ in history] == list(range(1, STEPS + 1))
    assert max_difference(weights(folder / "run"), one_device(STEPS)) <= TOLERANCE


def test_a_global_batch_that_does_not_divide_over_the_replicas_is_refused(mirrored):
    folder, message = mirrored["batch 3"]
    assert message == "error: --batch_size 3 (the global batch) does not divide over 2 replicas; use a multiple of 2"
    assert not (folder / "run").exists()


@pytest.mark.parametrize("name", ["adam", "adam accumulated"])
def test_two_replicas_equal_one_device_with_adam(mirrored, micro_dir, name):
    """The strategy passed to train() builds the model and splits the global batch of 2, each
    replica's gradients compiled by XLA (and, accumulated, summed in its own variables); Adam
    on the micro model."""
    (folder, mirrored_history), (_, single_history) = mirrored[name], mirrored[f"{name} single"]
    np.testing.assert_allclose([loss for _, loss in mirrored_history], [loss for _, loss in single_history],
                               rtol=1e-5)
    a, b, before = weights_of(folder / "mirrored"), weights_of(folder / "single"), weights_of(micro_dir)
    # The keys' bias has a gradient of 0 (it adds the same q . b_k to a row's every score, which
    # the softmax ignores): what comes out is rounding, which Adam divides by its own size plus
    # epsilon (1e-8). Which rounding depends on the CPU's kernels: measured on two CPU kinds, the
    # runs moved it by up to 1.4e-6 to 2.5e-6 and differ there by a fifth to four fifths of that
    # (their mean moves within a tenth of each other on the AVX-512 one); elsewhere the runs
    # differ by 6e-8. So the keys' bias is held to the size of its move: with epsilon 1e-7 in the
    # mirrored run only, it moves a tenth as much (and the other weights differ by up to 2e-5).
    n_embd = a["model/h0/attn/c_attn/b"].shape[0] // 3
    for name in a:
        x, y = a[name], b[name]
        if name.endswith("attn/c_attn/b"):
            keys = slice(n_embd, 2 * n_embd)
            moves = [np.abs(w[keys] - before[name][keys]) for w in (x, y)]
            assert all(0 < m.max() < 2 * 2e-5 for m in moves), name  # 2 steps of at most about the learning rate
            ratio = moves[0].mean() / moves[1].mean()
            assert 2 / 3 < ratio < 3 / 2, f"{name}: the keys' bias moved {ratio:.2f} times as much mirrored"
            x, y = np.delete(x, keys), np.delete(y, keys)
        np.testing.assert_allclose(x, y, atol=1e-6, err_msg=name)


def test_lora_on_two_replicas_equals_one_device(mirrored):
    """LoRA adapters (rank 2, without XLA), gradients accumulated: the run folders' adapters."""
    (folder, mirrored_history), (_, single_history) = mirrored["lora"], mirrored["lora single"]
    np.testing.assert_allclose([loss for _, loss in mirrored_history], [loss for _, loss in single_history],
                               rtol=1e-5)
    a, b = (tensors(folder / run / "lora-2") for run in ("mirrored", "single"))
    for name in a:
        if name != lora.CONFIG:
            assert np.abs(b[name]).max() > 0
            np.testing.assert_allclose(a[name], b[name], atol=1e-5, err_msg=name)


def test_updates_whose_loss_is_not_finite_are_skipped_on_every_replica(mirrored):
    """--max_bad_steps: the first update of 1e30 sends the next losses to NaN; those updates are
    skipped, on both replicas as on one device (one replica's NaN skips all): the weights saved
    at steps 2 and 3 are step 1's, bit for bit."""
    folder = mirrored["skipping"][0]
    for run, (_, history) in (("mirrored", mirrored["skipping"]), ("single", mirrored["skipping single"])):
        assert [step for step, _ in history] == [1, 2, 3] and np.isfinite(history[0][1])
        assert not np.isfinite([loss for _, loss in history[1:]]).any(), history
        saved = [weights_of_step(folder / run, step) for step in (1, 2, 3)]
        for name in saved[0]:
            assert np.isfinite(saved[0][name]).all()
            np.testing.assert_array_equal(saved[1][name], saved[0][name], err_msg=name)
            np.testing.assert_array_equal(saved[2][name], saved[0][name], err_msg=name)


def weights_of_step(run_dir, step):
    reader = tf.train.load_checkpoint(str(run_dir / f"model-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def test_strategy_names(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert distribute.make_strategy("auto") is tf.distribute.get_strategy()  # one CPU, no cluster
    assert distribute.make_strategy("one") is tf.distribute.get_strategy()
    with pytest.raises(ValueError, match="--strategy multiworker needs TF_CONFIG"):
        distribute.make_strategy("multiworker")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"], "ps": ["c:3"]}}))
    assert distribute.cluster_size() == 3


def test_check_batch_and_chief():
    two = SimpleNamespace(num_replicas_in_sync=2)
    distribute.check_batch(4, two)
    with pytest.raises(ValueError, match="--batch_size 5 .* does not divide over 2 replicas"):
        distribute.check_batch(5, two)

    def worker(task_type, task_id, jobs=("worker",)):
        spec = SimpleNamespace(jobs=list(jobs))
        resolver = SimpleNamespace(task_type=task_type, task_id=task_id, cluster_spec=lambda: spec)
        return distribute.is_chief(SimpleNamespace(cluster_resolver=resolver))
    assert worker("worker", 0) and not worker("worker", 1)
    assert worker("chief", 0, ("chief", "worker")) and not worker("worker", 0, ("chief", "worker"))


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_dir, corpus, tmp_path_factory):
    """Two workers run towards step 1000 until, once the chief has saved a checkpoint, the other
    is killed; then the same command with --steps 2 past the step left resumes in the same run
    folder (one multi-worker run, from step 0 to there, for both tests below): the exit codes and
    outputs of both, and the step, checkpoints and weights the kill left."""
    tmp = tmp_path_factory.mktemp("workers")
    run_dir = tmp / "run"
    children = start_workers(flags(tiny_dir, corpus, tmp, steps=1000))
    while not (run_dir / "counter").exists() and children[0].poll() is None:
        time.sleep(0.1)
    children[1].send_signal(signal.SIGKILL)
    killed = finish(children, timeout=200)
    assert (run_dir / "counter").exists(), killed[0][2]
    step = int((run_dir / "counter").read_text())
    left = SimpleNamespace(step=step, checkpoints=run_folder.checkpoint_steps(str(run_dir)),
                           weights=weights(run_dir))  # complete, and loads
    resumed = finish(start_workers(flags(tiny_dir, corpus, tmp, steps=step + 2)))
    return SimpleNamespace(run_dir=run_dir, killed=killed, left=left, resumed=resumed)


def test_two_workers_equal_one_process(killed_and_resumed, one_device):
    """The weights of the two workers' run (resumed once) at its last step equal one device's at
    that step."""
    run_dir, last = killed_and_resumed.run_dir, killed_and_resumed.left.step + 2
    for code, _, err in killed_and_resumed.resumed:
        assert code == 0, err
    assert max_difference(weights(run_dir), one_device(last)) <= TOLERANCE
    assert sorted(os.listdir(run_dir)) == sorted(
        ["base_model.json", "checkpoint", "counter", "encoder.json", "hparams.json", "vocab.bpe",
         f"model-{last}.index",
         f"model-{last}.data-00000-of-00001", f"optimizer-{last}.index", f"optimizer-{last}.data-00000-of-00001"]
        + [f for f in os.listdir(run_dir) if f.startswith("events.")])


def test_killing_a_worker_stops_the_run_with_its_checkpoint_intact_and_resume_works(killed_and_resumed,
                                                                                      one_device):
    """The chief notices the dead worker: it exits 1 with the checkpoint to resume from (a chief
    that hung would run into `finish`'s timeout, one that went on would exit 0 at step 1000),
    which holds one device's weights of that step."""
    run_dir, left = killed_and_resumed.run_dir, killed_and_resumed.left
    (code, _, err), (killed, _, _) = killed_and_resumed.killed
    assert killed == -signal.SIGKILL
    assert code == 1, err
    lines = err.strip().splitlines()
    assert lines[-2].startswith("error: training stopped: "), err
    assert lines[-1] == (f"The last complete checkpoint is {run_dir}/model-{left.step}; run the same command "
                         "again (on every worker) to resume from it.")
    assert left.checkpoints == [left.step]
    assert max_difference(left.weights, one_device(left.step)) <= TOLERANCE

    for code, _, err in killed_and_resumed.resumed:
        assert code == 0, err
    assert int((run_dir / "counter").read_text()) == left.step + 2
