"""Shared fixtures; what tests share besides fixtures (paths, shapes, helpers) is in
`tests/helpers.py`, which tests import; no test imports conftest. `../shared` (beside the
repository root) holds the reference code and vocabulary; tests that need it skip with a reason
where it is absent. The tests pass in any order: pytest-randomly (requirements.txt) shuffles the
files and the tests in each file on every run, before the sort below puts the heaviest files
first; the run's summary names its order (`--randomly-seed=N` runs it again, `-p no:randomly`
keeps the files' own).

Model folders are written once per test worker (the 124M-shaped one once per run) by
`tfgpt2.testing.checkpoints.make_checkpoint` (the code behind `tfgpt2 make-checkpoint`), with
weights of std >= 0.1 so that a wrong mask, scale or epsilon shows in the logits. OpenAI's
code on the tiny and the 124M folders is started once per worker (`reference_tiny`,
`reference_124m`; test_model.py and test_train.py need the 124M one, a process of about 1 GB).
Models a test file loads (`tiny`, `gpt2_124m`) live as long as the file's tests, and the graphs
it traced are let go after it (`release_traced_graphs`); freed memory goes back to the system
(TF_ONEDNN_USE_SYSTEM_ALLOCATOR). What TensorFlow never lets go, each program XLA compiled, is
why the files that compile most run in a process of their own (`own_process`,
tests/own_process.py), as does 124M-shaped work (`helpers.in_child`): each worker stays under
4 GB (TFGPT2_MEMORY_LOG shows it, `log_memory`).
XLA's compiled programs are kept on disk for the run (TF_XLA_FLAGS' persistent cache), shared
by workers and children, and compiled with cheaper flags than XLA's defaults (XLA_FLAGS:
test_xla_flags.py bounds what they change). On a GPU, the workers share the device
(TF_FORCE_GPU_ALLOW_GROWTH); tests marked `gpu` need one and skip, saying so, where TensorFlow
sees none.
"""
import atexit
import collections
import fcntl
import gc
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

_STARTED = time.monotonic()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Each process takes GPU memory as it needs it, not all of it at start: several workers (and
# their children) share one GPU. Set before TensorFlow starts; a value the user set is kept.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
# oneDNN's own allocator (TensorFlow's default on x86) keeps every freed block for reuse, so a
# worker's resident memory stays at the peak of its heaviest test for the rest of the run. The
# system allocator gives freed memory back: the same kernels, a worker near its current need.
os.environ.setdefault("TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "1")
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
# Compiling is most of the suite's time: its programs are small and run briefly. XLA's CPU backend
# compiles them in about half the CPU time with its older fusion code generator and without LLVM's
# optimizations (tests/test_sample.py: 120 s of CPU against 203 s). The same operations: float32
# results move by float32 rounding, which test_xla_flags.py measures against XLA's defaults
# (TFGPT2_TEST_XLA_FLAGS: the flags set here, where the user's XLA_FLAGS leave them to the suite)
if "TFGPT2_TEST_XLA_FLAGS" not in os.environ:  # a child pytest (tests/own_process.py) has its parent's
    _ours = [flag for flag in ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")
             if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
    os.environ["TFGPT2_TEST_XLA_FLAGS"] = " ".join(_ours)
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_ours]).strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import MICRO, TINY, WIDE, model_folder, require_reference  # noqa: E402
from tests.own_process import pytest_configure, pytest_runtest_protocol  # noqa: E402, F401  (its hooks)
from tfgpt2.hparams import published_hparams  # noqa: E402
from tfgpt2.testing.checkpoints import make_checkpoint  # noqa: E402


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
_ran = collections.Counter()  # the tests of each file that this process has started


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each test file's start (the last file's fixtures torn down) the objects still alive
    (TensorFlow's, Keras', the session's fixtures: hundreds of thousands) are moved out of the
    cyclic garbage collector's reach: every full collection walked them all again, a second
    or more late in a worker (Keras runs one per `del` of a layer's variable), and a test of a
    late file could spend 16 s in them. Garbage is still found among the objects made after.
    Before that, where this process ran every test of the last file (its files whole, as with
    `--dist loadfile`), the graphs that file traced are let go (`release_traced_graphs`)."""
    if _frozen_at != [item.path]:
        last = _frozen_at[0] if _frozen_at else None
        if last is not None and _ran[last] == sum(i.path == last for i in item.session.items):
            release_traced_graphs()
        gc.collect()
        log_memory(last)
        _frozen_at[:] = [item.path]
        gc.freeze()
    _ran[item.path] += 1


def release_traced_graphs():
    """TensorFlow keeps each graph that a `tf.custom_gradient` function was traced into (the
    model's products, GELU, LayerNorm, softmax and remat: `gradients.written`, `products`) in its
    global gradient registry, with the variables the graph captured (TensorFlow issue 97697): a
    model a file loaded and traced would stay resident for the rest of the worker, 0.3 GB for
    `wide_dir`'s. Between files nothing alive needs those entries (the last file's fixtures are
    torn down; the session's are folders and child processes), so they are dropped."""
    ops = sys.modules.get("tensorflow.python.framework.ops")
    if ops is not None:
        registry = ops._gradient_registry._registry
        for name in [name for name in registry if name.startswith("CustomGradient-")]:
            del registry[name]


def pytest_terminal_summary(terminalreporter, config):
    """The seed of the run's shuffled order, which `-q` leaves out of the header."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None:
        terminalreporter.write_line(f"tests in the order of --randomly-seed={seed}")


def pytest_sessionfinish(session):
    log_memory(_frozen_at[0] if _frozen_at else None)


_last = {}  # the wall and CPU seconds when the last file ended


def log_memory(finished):
    """Where TFGPT2_MEMORY_LOG names a file, a line per test file that this process finished:
    worker, file, wall seconds, CPU seconds (its own and its ended children's), resident MB at
    its end, this process's peak resident MB so far, the largest ended child's peak so far
    (tab-separated; it measures the suite and asserts nothing)."""
    path = os.environ.get("TFGPT2_MEMORY_LOG")
    if not path or finished is None:
        return
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    now = {"wall": time.monotonic(), "cpu": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime}
    wall, cpu = (now[k] - _last.get(k, 0 if k == "cpu" else _STARTED) for k in ("wall", "cpu"))
    _last.update(now)
    with open(path, "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{Path(finished).name}\t{wall:.1f}\t{cpu:.1f}"
                f"\t{resident:.0f}\t{own.ru_maxrss / 1024:.0f}\t{children.ru_maxrss / 1024:.0f}\n")


def gpu_visible():
    import tensorflow as tf
    return bool(tf.config.list_physical_devices("GPU"))


# The files that take longest, most first, by their tests' time in a full run (`--durations=0`,
# setup and call summed per file). Out of date, it costs time only.
HEAVIEST = ["test_serve.py", "test_train.py", "test_sample.py", "test_export.py", "test_benchmarks.py",
            "test_package.py", "test_doors.py", "test_generate_batch.py", "test_distribute.py", "test_model.py",
            "test_low_precision_doors.py", "test_precision.py", "test_beam.py"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """2 layers, n_embd 64, the real vocabulary size; std 0.3 weights."""
    return model_folder(tmp_path_factory, "tiny", TINY, 0.3)


@pytest.fixture(scope="session")
def wide_dir(tmp_path_factory):
    """The 355M block shape (n_head 16, n_embd 1024) with 2 layers; std 0.1 weights."""
    return model_folder(tmp_path_factory, "wide", WIDE, 0.1)


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    """One block of width 32, std 0.3 weights: for the tests that compare fine-tuning runs with
    runs (quicker to compile)."""
    return model_folder(tmp_path_factory, "micro", MICRO, 0.3, seed=2)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The model of `tiny_dir`, loaded once per test file (its compiled functions freed with it)."""
    from tfgpt2.formats.checkpoint import load_model
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def last_logits(tiny):
    """f(row) -> `tiny`'s float32 logits after the last token of one row, by a plain forward
    pass (`model(X)`, no cache), compiled once for any row length: the last block's output at the
    last position through the final norm and `wte` (the logits of the other positions, unused,
    are left out of the graph: a fifth of the time)."""
    import tensorflow as tf
    spec = tf.TensorSpec([1, None], tf.int32)
    f = tf.function(lambda x: tiny.lm_logits(tiny(x, return_hidden=True)["hidden"][:, -1, -1:])[0, -1],
                    input_signature=[spec], autograph=False)
    return lambda row: f(tf.constant([row], tf.int32)).numpy()


@pytest.fixture(scope="session")
def gpt2_124m_dir(tmp_path_factory):
    """124M-shaped weights of std 0.1 (about 500 MB on disk), written once for all the run's
    workers (in the folder above theirs, under a lock): read it, never write into it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return model_folder(tmp_path_factory, "124M", published_hparams("124M"), 0.1)
    shared = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's
    with open(shared / "124M.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((shared / "models" / "124M" / name).is_file() for name in ("checkpoint", "vocab.bpe")):
            make_checkpoint(str(shared / "models" / "124M"), published_hparams("124M"), std=0.1, seed=1)
    return str(shared / "models" / "124M")


@pytest.fixture(scope="module")
def gpt2_124m(gpt2_124m_dir):
    """The 124M-shaped model of `gpt2_124m_dir`, loaded once per test file that reads it (never
    assign its weights; generating is fine), and freed after it."""
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
