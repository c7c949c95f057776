"""How the decoding steps multiply a few rows by the block weights, for XLA on a CPU.

Decoding spends its time reading the weights. XLA's CPU backend multiplies a few rows by a
[nx, nf] weight on one core; by a copy of it as [nf, nx] (`transposed`), or as k products over
slices of nx at one row (`split`, no copy), on all of them (docs/performance.md); a 16-bit
model's one row reads 16-bit copies as [nf, nx] (`one_row16`), and its prompt float32 copies
(`widened`); on a CPU with BF16 instructions (`native_bfloat16`) a bfloat16 prompt
reads none, its pass run outside XLA, where TensorFlow's kernels multiply bfloat16 natively.
Where the CPU has AVX-512 (BF16, VNNI), a model's steps of a few rows read its weights once as
they are held, by the kernels (`rows`, `tfgpt2.kernels`): XLA's products of 16-bit and int8
weights run at a fraction of the memory's rate at one row, and as float32 at more; of a few rows
by float32 weights, short of it (docs/performance.md).
On a GPU the layer's own product is the fast one, so none of this is used there. Same numbers
either way (the 16-bit copy's products sum in another order: to a rounding of the logits).
"""
import functools
from typing import NamedTuple

import tensorflow as tf

from .. import kernels

TRANSPOSE_FROM = 16  # new tokens from which another layout repays its copy
ROWS = 16            # the most rows a decoding step multiplies by the row kernels (`rows`)
SPLIT_K = 8          # at batch 1, into how many products over slices of nx


def transpose_pays(length, *, cpu, jit_compile=True):
    """Whether decoding `length` new tokens uses another layout: on a CPU, under XLA, from
    TRANSPOSE_FROM new tokens on (above batch 1 they repay the copy: 340 MB for 124M, freed
    after the call). `length` may be a tensor."""
    return tf.logical_and(bool(cpu and jit_compile), length >= TRANSPOSE_FROM)


@functools.lru_cache(maxsize=None)
def native_bfloat16(cpuinfo="/proc/cpuinfo"):
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX, as `cpuinfo`
    names them). TensorFlow's own kernels (oneDNN) then multiply a prompt's rows in bfloat16
    faster than in float32; XLA's CPU backend multiplies bfloat16 as float32 on any CPU."""
    return any(kernels.cpu_has((flag,), cpuinfo) for flag in ("avx512_bf16", "amx_bf16"))


def usable(model):
    """Whether the layouts can read the block weights: not where `model.quantize` made them int8
    (their products are the layers' own)."""
    return not any(conv.quantization_mode for block in model.h for conv in convs(block))


def transposed(model):
    """Each block's four Conv1D weights copied as [nf, nx] (XLA only: the product that reads
    them needs an optimization barrier), in float32: at more rows XLA's CPU backend multiplies
    16-bit operands as float32 copies, which it would otherwise make again at each call (at each
    token of a server's step); so the same numbers, read at float32's cost."""
    return [tuple(_transposed(conv, model, tf.float32) for conv in convs(block)) for block in model.h]


class Rows(NamedTuple):
    """A weight held as [nf, nx] (16-bit or int8) that a product of a few rows reads by the row
    kernels (`kernels.row_product`)."""
    w: tf.Tensor


class Columns(NamedTuple):
    """A float32 layer's own weight [nx, nf] that a product of a few rows reads by the column
    kernel (`kernels.column_product`)."""
    w: tf.Tensor


def rows(model):
    """A model's block weights for a decoding step of at most ROWS rows, read by the kernels: a
    float32 model's own weights (`Columns`), a 16-bit model's copies as [nf, nx] in its dtype
    (`Rows`, 170 MB for 124M), an int8 model's own weights (held so, `Rows`); None where the
    kernels do not multiply the model's dtype here."""
    dtype = tf.int8 if not usable(model) else tf.as_dtype(model.compute_dtype)
    if not kernels.supports(dtype):
        return None
    if dtype == tf.float32:
        return [tuple(Columns(tf.reshape(conv.w, [-1, conv.nf])) for conv in convs(block)) for block in model.h]
    held = (lambda conv: tf.convert_to_tensor(conv.w)) if dtype == tf.int8 else (
        lambda conv: _transposed(conv, model, dtype))
    return [tuple(Rows(held(conv)) for conv in convs(block)) for block in model.h]


def one_row16(model):
    """A 16-bit model's block weights for one row (`cache.project`) where the row kernels do not
    run: each a copy as [nf, nx] in its dtype, each output's weights in a row, converted as the
    product reads them (170 MB for 124M), but attention's `c_proj`, a float32 copy [nx, nf] (as
    `widened`'s): XLA's CPU backend reads the 16-bit copy of that square weight at a fraction of
    the others' bytes per second, and its float32 copy at about the memory's rate
    (docs/performance.md)."""
    dtype = model.compute_dtype
    return [tuple((_widened(conv, model),) if conv is block.attn.c_proj else _transposed(conv, model, dtype)
                  for conv in convs(block)) for block in model.h]


def by_rows(layouts):
    """Whether `layouts` (one per block, or None) are read by the kernels (`rows`)."""
    return bool(layouts) and isinstance(layouts[0][0], (Rows, Columns))


def widened(model):
    """Each block's four Conv1D weights as float32 copies [nx, nf], each in a one-tuple, for a
    16-bit model's products at more rows (its prompt) and at steps too few for another layout:
    XLA's CPU backend would convert each 16-bit weight inside the program at each call, several
    times slower than TensorFlow makes these (340 MB for 124M, freed after the call). The same
    numbers: XLA multiplies 16-bit operands as float32 anyway."""
    return [tuple((_widened(conv, model),) for conv in convs(block)) for block in model.h]


def _transposed(conv, model, dtype):
    return tf.transpose(tf.reshape(tf.cast(model.as_compute(conv.w), dtype), [-1, conv.nf]))


def _widened(conv, model):
    return tf.cast(model.as_compute(conv.w)[0], tf.float32)


def head(model):
    """A 16-bit model's `wte` (or `out_head`) as a float32 copy, for the logits of several rows
    and the lookup (`cache.held_logits`); None for a float32 one. 154 MB for 124M."""
    w = model.as_compute(model.output_weight())
    return None if w.dtype == tf.float32 else tf.cast(w, tf.float32)


def split(model, k=SPLIT_K):
    """At one row: each product as k over slices of nx, without copying any weight."""
    return [(k,) * 4] * len(model.h)


def convs(block):
    """A block's four Conv1D layers, in the order `cache.block_with_cache` uses a layout's."""
    return (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
