"""Products of a few rows on the CPU's own AVX-512 instructions (`rows.cc`), each weight read
once as it is held: y = x w^T for x [m, nx] and w [nf, nx], bfloat16 into float32 (AVX-512
BF16), float32, or int8 into int32 (VNNI, exact) (`row_product`); bfloat16 y = x w^T + b as a
bfloat16 layer computes it (`biased_row_product`); y = x w for float32 w [nx, nf] as a layer
holds it (`column_product`); and the attention of one new position per row over a cache held
in blocks, read in place (`cached_attention`). XLA's CPU backend multiplies 16-bit and 8-bit
operands as float32 or int32 copies, and a few rows by any weight, at a fraction of the
memory's rate; a decoding step at a few rows is that product, over every weight
(docs/performance.md).

XLA ops only: the decoding programs' products and attention on a CPU use them
(`decoding.layouts.rows`); nothing exported (SavedModel, LiteRT) holds them. Built from the
source at first use, as TensorFlow builds a custom op (`tf.sysconfig`'s flags, the C++ compiler `CXX` or g++), into
the user's cache folder under a name that digests the source, TensorFlow's version and the
compiler, then loaded into the process. The products are not used (`supports` is false) where
the CPU lacks the instructions, no compiler is found, the build fails (a warning says why), or
TFGPT2_KERNELS=0.
"""
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import tensorflow as tf

SOURCE = Path(__file__).with_name("rows.cc")
FLAGS = {tf.bfloat16: ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), tf.float32: ("avx512f", "avx512bw"),
         tf.int8: ("avx512f", "avx512bw", "avx512_vnni")}
OUTPUT = {tf.bfloat16: tf.float32, tf.float32: tf.float32, tf.int8: tf.int32}


def row_product(x, w):
    """x [m, nx] @ w [nf, nx]^T: bfloat16 or float32 into float32, int8 into int32, inside an
    XLA program on a CPU, in parts that run side by side on the cores XLA uses. Raises where
    `supports` is false for the dtype."""
    if not supports(x.dtype):
        raise ValueError(f"no row product for {x.dtype.name} on this machine (tfgpt2.kernels.supports)")
    return library().row_product(x, w, U=OUTPUT[x.dtype], parts=cores())


def biased_row_product(x, w, b):
    """x [m, nx] @ w [nf, nx]^T + b [nf], all bfloat16, as a bfloat16 `Conv1D` computes it (the
    product rounded to bfloat16, b added, rounded), in one pass: no operation of XLA's after it."""
    if not supports(tf.bfloat16):
        raise ValueError("no row product for bfloat16 on this machine (tfgpt2.kernels.supports)")
    return library().biased_row_product(x, w, b, parts=cores())


def column_product(x, w):
    """x [m, nx] @ w [nx, nf], float32 (a layer's own weight), as `row_product` runs."""
    if not supports(tf.float32):
        raise ValueError("no column product on this machine (tfgpt2.kernels.supports)")
    return library().column_product(x, w, parts=cores())


def cached_attention(q, rows, first, last, k_new, v_new, k, v, scale):
    """One new position per row over a cache held in blocks (k and v: lists of float32 blocks
    [cache rows, length, d], the positions in order): row i's new key and value (k_new and v_new
    [n, d] float32) written at position last[i] of cache row rows[i] (none past the blocks'
    end), then the attention of q [n, d] (bfloat16 or float32) over positions first[i] ..
    last[i] of that row (at most the blocks' end), the scores scaled by `scale`, as
    `cache.cached_attn` computes it; rows, first and last int32 [n]. The blocks are updated and
    read in place, only the positions attended. Returns (a [n, d] in q's dtype, the k blocks,
    the v blocks). Raises where `supports` is false for q's dtype."""
    if not supports(q.dtype):
        raise ValueError(f"no cached attention for {q.dtype.name} on this machine (tfgpt2.kernels.supports)")
    return library().cached_attention(q, rows, first, last, scale, k_new, v_new, k, v, parts=cores())


def huge_pages(tensors):
    """Asks Linux to back each tensor's memory (the whole 2 MB pages inside its buffer) by huge
    pages, moving it there now (MADV_COLLAPSE copies it, once; a tensor already there costs a
    system call). Decoding reads every weight at each step, which in 4 KB pages misses the TLB
    at every page (docs/performance.md, "Huge pages"). The bytes moved; 0 where the library is
    not here or Linux refuses (transparent huge pages off, Linux before 6.1)."""
    if library() is None:
        return 0
    return sum(int(library().huge_pages(t)) for t in tensors)


def supports(dtype):
    """Whether the products run for `dtype` (bfloat16, float32 or int8) here."""
    dtype = tf.as_dtype(dtype)
    return dtype in FLAGS and cpu_has(FLAGS[dtype]) and library() is not None


def cores():
    """The threads XLA's CPU runtime runs the parts on: TensorFlow's intra-op threads."""
    return tf.config.threading.get_intra_op_parallelism_threads() or len(os.sched_getaffinity(0))


@functools.lru_cache(maxsize=None)
def cpu_has(flags, cpuinfo="/proc/cpuinfo"):
    """Whether the CPU names every one of `flags` (as /proc/cpuinfo spells them)."""
    try:
        with open(cpuinfo) as f:
            named = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return set(flags) <= set(named)


@functools.lru_cache(maxsize=None)
def library():
    """The loaded op library (built where not yet), or None (see the module's docstring)."""
    if os.environ.get("TFGPT2_KERNELS", "1") == "0" or not cpu_has(("avx512f", "avx512bw")):
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return None
    flags = [compiler, "-shared", "-fPIC", "-O3", "-w", *tf.sysconfig.get_compile_flags(),
             *(f"-I{Path(tf.sysconfig.get_include()) / 'external' / name}" for name in (
                 "highwayhash", "farmhash_archive/src"))]
    libraries = [*tf.sysconfig.get_link_flags(), "-l:libtensorflow_cc.so.2"]
    # named by what it is built from and with, not by where the source is: copies of the package share it
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), tf.__version__, *flags, *libraries]).encode())
    path = cache_folder() / f"rows-{digest.hexdigest()[:16]}.so"
    command = [*flags, str(SOURCE), *libraries]
    if not path.exists():
        try:
            build(command, path)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            warnings.warn(f"tfgpt2.kernels: building {SOURCE.name} failed, so decoding multiplies its weights "
                          f"as XLA does: {detail[-2000:]}")
            return None
    return tf.load_op_library(str(path))


def build(command, path):
    """Compiles `command` into `path`, through a file beside it renamed when whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([*command, "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def cache_folder():
    """Where built libraries are kept: $TFGPT2_CACHE, else $XDG_CACHE_HOME/tfgpt2 (~/.cache/tfgpt2)."""
    if os.environ.get("TFGPT2_CACHE"):
        return Path(os.environ["TFGPT2_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tfgpt2"
