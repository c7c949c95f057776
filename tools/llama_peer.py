"""llama.cpp as a peer in the benchmarks, on the GGUF file of the same weights (`tfgpt2 convert
--to gguf`), optional as KerasHub and transformers are.

The peer is llama.cpp's own programs where `--llama_cpp DIR` names the folder its build wrote
them to (`llama-bench` for generation, `llama-server` for serving), else llama-cpp-python where
it is installed (its bindings to the same library). Its weights are the model folder's, written
as GGUF in the type that matches tfgpt2's dtype (`GGUF_TYPES`: float32 as f32, 16 bits as f16,
int8 as q8_0) unless `--gguf_type` says otherwise. Each report says which peer ran.
"""
import importlib.metadata
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import time

try:
    from . import report
except ImportError:  # run as `python tools/<tool>.py`: this folder is on sys.path
    import report

GGUF_TYPES = {"float32": "f32", "bfloat16": "f16", "float16": "f16", "mixed_bfloat16": "f16", "mixed_float16": "f16",
              "int8": "q8_0"}


def add_arguments(parser):
    parser.add_argument("--llama_cpp", metavar="DIR",
                        help="llama.cpp's programs (llama-bench, llama-server) in DIR as the peer; without it, "
                             "llama-cpp-python where installed")
    parser.add_argument("--gguf_type", choices=("f32", "f16", "q8_0"),
                        help="the peer's weights (default: as tfgpt2's dtype: float32 f32, 16 bits f16, int8 q8_0)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="the peer's threads (default: the CPUs)")
    return parser


def peer(args):
    """"programs" (`--llama_cpp`), "python" (llama-cpp-python) or None where neither is at hand."""
    if args.llama_cpp:
        return "programs" if os.path.isfile(program(args, "llama-bench")) else None
    return "python" if importlib.util.find_spec("llama_cpp") else None


def program(args, name):
    return os.path.join(os.path.expanduser(args.llama_cpp), name)


def gguf_type(args):
    return args.gguf_type or GGUF_TYPES.get(args.dtype, "f32")


def describe(args):
    """The peer as the reports name it: llama.cpp's build, or llama-cpp-python's version; its
    weights' type and threads."""
    if peer(args) == "programs":
        done = subprocess.run([program(args, "llama-bench"), "--version"], capture_output=True, text=True)
        found = re.search(r"version: (\S+) \(build (\d+), commit (\w+)\)", done.stdout + done.stderr)
        build = f"{found[1]}, build {found[2]}, {found[3]}" if found else "its build unknown"
        what = f"llama.cpp's llama-bench and llama-server ({build})"
    else:
        what = f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')}"
    return f"{what}, {gguf_type(args)} weights, {args.threads} threads"


def write_gguf(model_dir, outtype, folder):
    """The GGUF file of `model_dir` in `outtype`, written by `tfgpt2 convert` into `folder`."""
    path = os.path.join(folder, f"{os.path.basename(os.path.normpath(model_dir))}-{outtype}.gguf")
    subprocess.run([sys.executable, "-m", "tfgpt2.cli.main", "convert", "--from", "openai", "--to", "gguf",
                    model_dir, path, "--outtype", outtype, "--quiet"], check=True, cwd=report.ROOT,
                   env=dict(os.environ, PYTHONPATH=report.ROOT, TF_CPP_MIN_LOG_LEVEL="3"))
    return path


def bench(args, path, *, prompt, new, depth=0):
    """llama-bench's tokens/s of each of `--runs` repetitions (after its warm-up): a prompt of
    `prompt` tokens, or `new` tokens generated one at a time after `depth` in the cache."""
    command = [program(args, "llama-bench"), "-m", path, "-t", str(args.threads), "-r", str(args.runs),
               "-p", str(prompt), "-n", str(new), "-d", str(depth), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)[0]["samples_ts"]


def peak_rss_mb():
    """The largest resident set of the children waited for so far (llama-bench's), in MB."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def python_runner(args, path, n_ctx):
    """run(context, length): llama-cpp-python reads `context` (one row), then generates
    `length` tokens one at a time, each its last logits' argmax."""
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, verbose=False)

    def run(context, length):
        llm.reset()
        llm.eval([int(t) for t in context[0]])
        for _ in range(length):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return run


def start_server(args, path, slots, port):
    """`llama-server` on `path` with `slots` parallel sequences, once it answers: (process, URL)."""
    import httpx
    command = [program(args, "llama-server"), "-m", path, "-t", str(args.threads), "-tb", str(args.threads),
               "-np", str(slots), "-c", str(slots * args.slot_context), "--port", str(port), "--host", "127.0.0.1",
               "--no-webui", "-a", "bench"]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while child.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return child, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server exited with {child.returncode}")
