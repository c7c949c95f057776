"""What several test files share, besides conftest's fixtures: paths, model shapes, ports, the
fine-tuning runs, the benchmark reports' checks, a fake of OpenAI's storage, the import graph's
reading and the samplers' statistics. A helpers module, not a test file: tests import it
(`from tests.helpers import ...`); no test file imports another, or conftest.

It imports nothing heavy as it loads (TensorFlow, the tools): conftest imports it before
TensorFlow starts, with the process's settings made."""
import ast
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tfgpt2.testing.reference_diff import ATOL  # noqa: F401  the one tolerance against the reference

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TFGPT2_SHARED", ROOT.parent / "shared"))
REFERENCE_SRC = SHARED / "openai-gpt-2" / "src"
PACKAGE = ROOT / "tfgpt2"

TINY = dict(n_vocab=50257, n_ctx=64, n_embd=64, n_head=4, n_layer=2)
WIDE = dict(n_vocab=50257, n_ctx=128, n_embd=1024, n_head=16, n_layer=2)
MICRO = dict(n_vocab=50257, n_ctx=32, n_embd=32, n_head=2, n_layer=1)



def require_reference():
    """Skip the calling test where OpenAI's reference code is not available."""
    if not (REFERENCE_SRC / "model.py").is_file():
        pytest.skip(f"reference code not found at {REFERENCE_SRC} (set TFGPT2_SHARED)")
    return REFERENCE_SRC


def model_folder(tmp_path_factory, name, hparams, std, seed=1):
    """A random-weight checkpoint folder `name` of `hparams` (a dict over the defaults) with
    weights of std `std`, in a fresh folder of the session's."""
    from tfgpt2.hparams import default_hparams
    from tfgpt2.testing.checkpoints import make_checkpoint
    if isinstance(hparams, dict):
        hparams = default_hparams().override_from_dict(hparams)
    return str(make_checkpoint(str(tmp_path_factory.mktemp("models") / name), hparams, std=std, seed=seed))


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


def free_ports(n=1):
    """`n` distinct ports of 127.0.0.1 free as this returns (bound together, then released)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port():
    """A port of 127.0.0.1 free as this returns (nothing listens on it)."""
    return free_ports(1)[0]


def in_child(function, *args, timeout=900):
    """`function(*args)` in a fresh Python process that ends with it, its result or its exception
    raised here: 124M-shaped work leaves the test worker's memory as it was (a worker never gives
    back the peak of TensorFlow's allocations). `function` is a module-level function of a test
    file."""
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result(timeout=timeout)


# ---- checkpoints and fine-tuning runs ---------------------------------------------------------

SAMPLE_LENGTH = 16  # a run's windows: 17 tokens


def ids_npz(path, *chunks):
    """An .npz dataset of token-id chunks at `path`; returns the path as a str."""
    np.savez_compressed(path, *[np.asarray(c, np.int32) for c in chunks])
    return str(path)


def random_ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 50257, n)


def tensors(prefix):
    """{name: array} of the checkpoint at `prefix`."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(prefix))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def weights_of(folder):
    """{name: array} of the latest checkpoint in `folder`."""
    import tensorflow as tf
    return tensors(tf.train.latest_checkpoint(folder))


def run(model_dir, tmp_path, *more, run_name="run1"):
    """train.train with the flags `more`, the base model `model_dir`, no samples or periodic saves."""
    from tfgpt2.cli import train as train_cli
    from tfgpt2.train import loop
    argv = ["--models_dir", os.path.dirname(model_dir), "--model_name", os.path.basename(model_dir),
            "--checkpoint_dir", str(tmp_path / "checkpoint"), "--run_name", run_name,
            "--sample_every", "0", "--save_every", "0", "--print_every", "0",
            "--sample_length", str(SAMPLE_LENGTH), *more]
    return loop.train(train_cli.parse_config(argv))


def run_interrupted(monkeypatch, update, *args, **kwargs):
    """`run(*args, **kwargs)` with Ctrl-C during its `update`-th update."""
    from tfgpt2.train import loop
    from tfgpt2.train.step import Trainer
    step = Trainer.step
    calls = []

    def interrupted(self, batch):
        calls.append(1)
        if len(calls) == update:
            raise KeyboardInterrupt
        return step(self, batch)
    monkeypatch.setattr(Trainer, "step", interrupted)
    try:
        with pytest.raises(loop.Interrupted) as e:  # once saved
            run(*args, **kwargs)
        return e.value.history
    finally:
        monkeypatch.undo()


# ---- generation ---------------------------------------------------------------------------------

def prompts_for(seed, lengths, n_vocab=50257):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, size=n).tolist() for n in lengths]


def chi_square(counts, probs):
    """Chi-square statistic of counts against probabilities (zero-probability cells must be empty)."""
    assert counts[probs == 0].sum() == 0, "drew a token the filter removed"
    expected = probs[probs > 0] * counts.sum()
    return (((counts[probs > 0] - expected) ** 2) / expected).sum()


def filtered_softmax(logits, keep):
    p = np.where(keep, np.exp(logits - logits.max()), 0.0)
    return p / p.sum()


def reference_logits(logits, prompt, new, *, logit_bias=None, repetition_penalty=1.0, presence_penalty=0.0,
                     frequency_penalty=0.0, **_):
    """The semantics of the controls that act on logits, one row, in float32."""
    logits = logits.astype(np.float32).copy()
    for token, value in (logit_bias or {}).items():
        logits[token] += np.float32(-np.inf if value <= -100 else value)
    if repetition_penalty != 1.0:
        seen = sorted(set(prompt) | set(new))
        p = np.float32(repetition_penalty)
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / p, logits[seen] * p)
    counts = np.bincount(np.asarray(new, np.int64), minlength=len(logits)).astype(np.float32)
    return logits - (np.float32(frequency_penalty) * counts + np.float32(presence_penalty) * (counts > 0))


def samples(out):
    """[(number, text)] under the original's banners, each text without print's newline."""
    parts = re.split(r"^=+ SAMPLE (\d+) =+\n", out, flags=re.M)
    assert parts[0] == "", out
    return [(int(n), text[:-1]) for n, text in zip(parts[1::2], parts[2::2])]


MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def all_nodes(graph_def):
    """The nodes of a GraphDef and of the functions in its library."""
    return list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]


def products(graph_def):
    """{precision: count} of the float32 products in a GraphDef and its function library:
    "HIGHEST" or "DEFAULT" for XLA's dot (its operands' precision), "tf.matmul" for the others."""
    import tensorflow as tf
    from tensorflow.compiler.xla import xla_data_pb2
    found = {}
    for node in all_nodes(graph_def):
        if node.op in ("XlaDot", "XlaDotV2"):
            config = xla_data_pb2.PrecisionConfig.FromString(node.attr["precision_config"].s)
            names = {xla_data_pb2.PrecisionConfig.Precision.Name(p) for p in config.operand_precision} or {"DEFAULT"}
            kind = names.pop() if len(names) == 1 else str(sorted(names))
        elif node.op in MATMULS and tf.as_dtype(node.attr["Ta" if "Ta" in node.attr else "T"].type) == tf.float32:
            kind = "tf.matmul"
        else:
            continue
        found[kind] = found.get(kind, 0) + 1
    return found


# ---- the benchmarks' reports ------------------------------------------------------------------

REPORT_KEYS = {"name", "title", "tool", "command", "machine", "versions", "date", "commit", "local_changes",
               "settings", "notes", "tables", "headlines"}


def run_tool(tool, *flags, env=None, timeout=600):
    """`python tools/<tool> FLAGS` from the repository root, as the docs say to run it."""
    return subprocess.run([sys.executable, f"tools/{tool}", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def table_lines(markdown, columns):
    """The rows of the Markdown table whose header row is `columns`' headers, as lists of cells."""
    header = "| " + " | ".join(c["header"] for c in columns) + " |"
    lines = markdown.splitlines()
    start = lines.index(header) + 2  # header, alignment row
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def assert_report(folder, name, tool):
    """The report `name` in `folder`: every key, this machine and these versions, the command
    that wrote it, and a Markdown file that is the JSON's rendering and shows each row's figures
    (a spread's median first). Returns the JSON."""
    import json
    from tools import report
    from tools.machine import describe
    with open(os.path.join(folder, f"{name}.json")) as f:
        data = json.load(f)
    with open(os.path.join(folder, f"{name}.md")) as f:
        text = f.read()
    assert set(data) == REPORT_KEYS, data.keys()
    assert data["name"] == name and data["tool"] == f"tools/{tool}"
    assert data["command"].startswith(f"python tools/{tool} ")
    assert data["machine"] == describe()
    assert {"python", "tensorflow", "keras", "numpy", "tiktoken"} <= set(data["versions"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", data["date"])
    assert re.fullmatch(r"[0-9a-f]{4,40}|unknown", data["commit"])
    assert text == report.markdown(data)
    assert text.startswith(f"## {data['title']}\n")
    assert f"`{data['command']}`" in text and data["machine"] in text and data["date"][:10] in text
    assert f"tensorflow {data['versions']['tensorflow']}" in text and "commit" not in text  # the commit stays in the JSON
    for t in data["tables"]:
        shown = table_lines(text, t["columns"])
        assert len(shown) == len(t["rows"])
        for row, cells in zip(t["rows"], shown):
            for c, cell in zip(t["columns"], cells):
                value = row.get(c["key"])
                assert cell == report.cell(value, c["format"]).replace("\\|", "|")
                if report.is_spread(value):
                    assert cell.split(" (")[0] == format(value["median"], c["format"])
                    assert value["min"] <= value["median"] <= value["max"]
    return data


def rows(data, table=0):
    return data["tables"][table]["rows"]


# ---- a fake of OpenAI's storage ---------------------------------------------------------------

class Storage:
    """Serves files under /models/<name>/ and records (method, path, Range) of each request.
    cut: path -> bytes sent before the connection drops, once.  promise: path -> the
    Content-Length announced for the whole file (the body stays true).  grow: path -> bytes
    that GET appends to the body and its Content-Length, which HEAD does not announce."""

    def __init__(self, files, ranges=True):
        self.files = files
        self.ranges = ranges
        self.requests = []
        self.cut, self.promise, self.grow = {}, {}, {}

    def gets(self):
        return [path for method, path, _ in self.requests if method == 'GET']


class StorageHandler(BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.serve(send_body=False)

    def do_GET(self):
        self.serve(send_body=True)

    def serve(self, send_body):
        store = self.server.store
        store.requests.append((self.command, self.path, self.headers.get('Range')))
        data = store.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        if send_body:
            data += store.grow.get(self.path, b'')
        total = store.promise.get(self.path, len(data))
        match = re.fullmatch(r'bytes=(\d+)-', self.headers.get('Range') or '')
        start = int(match.group(1)) if match and store.ranges else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header('Content-Range', f'bytes {start}-{total - 1}/{total}')
        self.send_header('Content-Length', str(total - start))
        self.end_headers()
        if send_body:
            body = data[start:start + store.cut.pop(self.path, total)]
            self.wfile.write(body)
            self.close_connection = len(body) < total - start


@contextlib.contextmanager
def serving(store):
    """`store` served on an ephemeral port of 127.0.0.1 while in it; sets store.url, its base URL."""
    server = ThreadingHTTPServer(('127.0.0.1', 0), StorageHandler)
    server.store = store
    store.url = f'http://127.0.0.1:{server.server_address[1]}'
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield store
    finally:
        server.shutdown()
        server.server_close()


# ---- the package's import graph ---------------------------------------------------------------

def module_name(path, root=ROOT):
    parts = list(Path(path).relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package=PACKAGE):
    """{dotted name: path} of every module in the package."""
    return {module_name(path, package.parent): path for path in sorted(package.rglob("*.py"))}


def resolve(importer, is_package, node, known):
    """The modules an `import` or `from ... import` statement of module `importer` names, as
    dotted names (relative imports resolved; `from X import y` names X.y where that is a module
    of the package, else X)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    names = [f"{source}.{alias.name}" for alias in node.names]
    submodules = [name for name in names if name in known]
    return submodules if len(submodules) == len(names) else submodules + [source]
