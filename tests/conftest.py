"""Shared fixtures. `../shared` (beside the repository root) holds the reference code and
vocabulary; tests that need it skip with a reason where it is absent.

Model folders are written once per test worker (the 124M-shaped one once per run) by
`tfgpt2.testing.checkpoints.make_checkpoint` (the code behind `tfgpt2 make-checkpoint`), with
weights of std >= 0.1 so that a wrong mask, scale or epsilon shows in the logits. The
124M-shaped model is loaded once per worker (`gpt2_124m`) for the tests that only read it, and
OpenAI's code on the tiny and the 124M folders started once per worker (`reference_tiny`,
`reference_124m`; test_model.py and test_train.py need the 124M one, a process of about 1 GB).
XLA's compiled programs are kept on disk for the run (TF_XLA_FLAGS' persistent cache), shared
by workers and children. On a GPU, the workers share it (TF_FORCE_GPU_ALLOW_GROWTH); tests
marked `gpu` need one and skip, saying so, where TensorFlow sees none.
"""
import atexit
import collections
import fcntl
import gc
import os
import shutil
import signal
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Each process takes GPU memory as it needs it, not all of it at start: several workers (and
# their children) share one GPU. Set before TensorFlow starts; a value the user set is kept.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
# TensorFlow's threads spin while they wait: a worker (and its children) using more intra-op
# threads than its share of the CPUs takes them from the other workers (a few per cent of the
# suite's time with two workers on two CPUs at TensorFlow's default, one thread per CPU each)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))
if "tf_xla_persistent_cache_directory" not in os.environ.get("TF_XLA_FLAGS", ""):
    # One XLA compilation cache on disk for the run (set before TensorFlow starts): the same
    # programs (tiny models, the same buckets) compile once for all tests, workers and children
    _cache = tempfile.mkdtemp(prefix="tfgpt2-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    _flags = os.environ.get("TF_XLA_FLAGS", "")
    os.environ["TF_XLA_FLAGS"] = f"{_flags} --tf_xla_persistent_cache_directory={_cache}".strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tfgpt2.testing.reference_diff import ATOL  # noqa: E402,F401  the one tolerance against the reference
from tfgpt2.hparams import default_hparams, published_hparams  # noqa: E402
from tfgpt2.testing.checkpoints import make_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TFGPT2_SHARED", ROOT.parent / "shared"))
REFERENCE_SRC = SHARED / "openai-gpt-2" / "src"

TINY = dict(n_vocab=50257, n_ctx=64, n_embd=64, n_head=4, n_layer=2)
WIDE = dict(n_vocab=50257, n_ctx=128, n_embd=1024, n_head=16, n_layer=2)


def pytest_collection_modifyitems(items):
    """The heaviest files first (HEAVIEST, in its order), then the others by their count of
    slow tests, each file's tests in their order: the README's test command hands whole files
    to two workers (`-n 2 --dist loadfile`, with pyproject's `--no-loadscope-reorder`, without
    which xdist orders the files by their count of tests), and starting the longest first lets
    both workers finish together. Tests marked `gpu` skip where no GPU is visible."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    rank = {name: i for i, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(HEAVIEST)), -slow[item.path]))  # stable: files whole
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not gpu_visible():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU; TensorFlow sees none here"))


_frozen_at = []  # the test file whose start last froze the heap


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each test file's start (the last file's fixtures torn down) the objects still alive
    (TensorFlow's, Keras', the session's fixtures: hundreds of thousands) are moved out of the
    cyclic garbage collector's reach: every full collection walked them all again, a second
    or more late in a worker (Keras runs one per `del` of a layer's variable), and a test of a
    late file could spend 16 s in them. Garbage is still found among the objects made after."""
    if _frozen_at != [item.path]:
        _frozen_at[:] = [item.path]
        gc.collect()
        gc.freeze()


def gpu_visible():
    import tensorflow as tf
    return bool(tf.config.list_physical_devices("GPU"))


# The files that take longest, most first, by the CPU time of a full run (their own and their
# child processes'). Out of date, it costs time only.
HEAVIEST = ["test_train.py", "test_sample.py", "test_export.py", "test_distribute.py", "test_generate_batch.py",
            "test_package.py", "test_precision.py", "test_benchmarks.py", "test_model.py"]


def require_reference():
    """Skip the calling test where OpenAI's reference code is not available."""
    if not (REFERENCE_SRC / "model.py").is_file():
        pytest.skip(f"reference code not found at {REFERENCE_SRC} (set TFGPT2_SHARED)")
    return REFERENCE_SRC


def execute_notebook(path):
    """Run the notebook at `path` (saved without outputs) top to bottom in a kernel of this
    interpreter, from its folder; returns its printed output."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells), f"save {path} without outputs"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(Path(path).parent)}}).execute()
    return "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))


def _folder(tmp_path_factory, name, hparams, std):
    return str(make_checkpoint(str(tmp_path_factory.mktemp("models") / name), hparams, std=std, seed=1))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """2 layers, n_embd 64, the real vocabulary size; std 0.3 weights."""
    return _folder(tmp_path_factory, "tiny", default_hparams().override_from_dict(TINY), 0.3)


@pytest.fixture(scope="session")
def wide_dir(tmp_path_factory):
    """The 355M block shape (n_head 16, n_embd 1024) with 2 layers; std 0.1 weights."""
    return _folder(tmp_path_factory, "wide", default_hparams().override_from_dict(WIDE), 0.1)


@pytest.fixture(scope="session")
def gpt2_124m_dir(tmp_path_factory):
    """124M-shaped weights of std 0.1 (about 500 MB on disk), written once for all the run's
    workers (in the folder above theirs, under a lock): read it, never write into it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _folder(tmp_path_factory, "124M", published_hparams("124M"), 0.1)
    shared = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's
    with open(shared / "124M.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((shared / "models" / "124M" / name).is_file() for name in ("checkpoint", "vocab.bpe")):
            make_checkpoint(str(shared / "models" / "124M"), published_hparams("124M"), std=0.1, seed=1)
    return str(shared / "models" / "124M")


@pytest.fixture(scope="session")
def gpt2_124m(gpt2_124m_dir):
    """The 124M-shaped model of `gpt2_124m_dir`, loaded once per worker: for tests that only
    read it (never assign its weights; generating is fine)."""
    from tfgpt2 import load_model
    model = load_model(gpt2_124m_dir)
    sums = [float(np.sum(v.numpy(), dtype=np.float64)) for v in model.weights]
    yield model
    changed = [v.path for v, s in zip(model.weights, sums) if float(np.sum(v.numpy(), dtype=np.float64)) != s]
    assert not changed, f"a test changed the shared gpt2_124m model: {changed}"


@pytest.fixture(scope="session")
def reference_tiny(tiny_dir):
    """OpenAI's code on `tiny_dir` in its child process, started once per worker."""
    from tfgpt2.testing.reference import Reference
    with Reference(str(require_reference()), tiny_dir) as ref:
        yield ref


@pytest.fixture(scope="session")
def reference_124m(gpt2_124m_dir):
    """OpenAI's code on `gpt2_124m_dir` in its child process (`tfgpt2.testing.reference`),
    started once per worker; skips where the reference code is absent."""
    from tfgpt2.testing.reference import Reference
    with Reference(str(require_reference()), gpt2_124m_dir) as ref:
        yield ref


@pytest.fixture
def signals():
    """The commands set SIGINT and SIGPIPE to their defaults; put back the test process's."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGPIPE)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
