"""The model's blocks over a fixed-size key/value cache written in place, for generation.

`model.py`'s `GPT2.call(X, past)` concatenates `past`, so every step has new shapes. Here each
layer's keys and values live in a buffer [batch * n_head, T_max, head_dim] that each step writes
at an index (in place inside an XLA loop), with left padding per row (`call_with_cache`), or
each row at a position of its own, in the rows of its slot, in blocks of BLOCK positions
(`call_with_slots`, the server's continuous batch: a step reads the blocks of its window whole,
where a slice of one buffer would be copied before each product). The layers, the mask and the
softmax are the model's own; only the order of the calls is written again. `layouts`
(`layouts.py`) change how the block weights are multiplied, never the numbers; with them, a
16-bit model's one-row logits read its 16-bit `wte` at each step (`held_logits`), and a step of
one new position per row stores and attends by the kernel (`kernels.cached_attention`).
"""
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from .. import kernels
from ..model import attention_mask, attn_probs, gelu, positions_for, shape_list
from ..products import matmul
from .layouts import Columns, Rows, by_rows

BLOCK = 64  # positions per block of a slot cache (`slot_cache`)


def empty_cache(model, batch, length, dtype=None):
    """The zero cache for `length` positions: per layer (keys, values), each
    [batch * n_head, length, head_dim] in the model's compute dtype, or `dtype` (separate
    tensors, so that XLA updates each in place)."""
    hp = model.hparams
    shape = [batch * hp.n_head, length, hp.n_embd // hp.n_head]
    return [(tf.zeros(shape, dtype or model.compute_dtype),) * 2 for _ in range(hp.n_layer)]


def blocks_for(positions):
    """The number of cache blocks that hold `positions` positions."""
    return -(-positions // BLOCK)


def window(positions, n_ctx):
    """The attention window (a compile bucket) for `positions` positions: whole blocks of the
    cache (`BLOCK`: 64, 128, 192, ...), at most n_ctx."""
    return min(blocks_for(positions) * BLOCK, n_ctx)


def slot_cache(model, slots, length):
    """The zero cache of `slots` slots of `length` positions (a multiple of BLOCK): per layer
    (keys, values), each a tuple of length / BLOCK blocks [slots * n_head, BLOCK, head_dim], in
    `slot_dtype`."""
    return [tuple((zeros,) * (length // BLOCK) for zeros in layer)
            for layer in empty_cache(model, slots, BLOCK, slot_dtype(model))]


def slot_dtype(model):
    """What a slot cache holds (and, under XLA on a CPU, `generator`'s): the compute dtype's values,
    a 16-bit dtype's widened to float32 (exactly). XLA's CPU backend gives attention's products
    a 16-bit block as a float32 copy of the whole block, made at each step (at 16 slots over 256
    positions, a third of a bfloat16 decode call; at one row, a time per token that grows with
    the positions held), and writes a row of one by converting the whole block to float32 and
    back; a float32 block goes to the products as it is, at twice the bytes."""
    return tf.float32 if tf.as_dtype(model.compute_dtype).size == 2 else model.compute_dtype


def call_with_cache(model, X, cache, cache_index, *, pad=None, layouts=None, table=None):
    """X [batch, T] through the blocks over `cache` (`empty_cache`), X's keys and values written
    at slot `cache_index`. `pad` [batch] counts each row's left-padding slots. `layouts`: one
    per block (`layouts.transposed` or `layouts.split`), or None. `table`: (embed(X),
    logits(h)) in place of `wte`'s lookup and `model.lm_logits` (the LiteRT int8 export's
    token table, `formats.litert`), or None.

    One new position per row with the row kernels' layouts (`layouts.rows`) over a float32
    cache: the keys and values written and attended by the kernel (`kernels.cached_attention`),
    which reads only the positions attended where XLA's products read the whole cache.

    Returns the logits of the last position [batch, n_vocab] (all that generation needs) and the
    updated cache. Inputs are not checked here: `request.check_request` (in a SavedModel,
    `request.assert_request`) checks them before XLA."""
    mask = padded_mask(shape_list(X)[1], shape_list(cache[0][0])[1], dtype=model.compute_dtype,
                       offset=cache_index, pad=pad)

    def write(old, new):
        stored = write_cache(old, tf.cast(new, old.dtype), cache_index)  # as the cache holds them
        return stored, [stored]
    attend = masked(mask, write)
    if X.shape[1] == 1 and by_rows(layouts) and cache[0][0].dtype == tf.float32:
        heads = model.hparams.n_head  # each row's heads attend from its first real token
        first = tf.repeat(tf.zeros(shape_list(X)[:1], tf.int32) if pad is None else tf.cast(pad, tf.int32), heads)
        attend = by_kernel_attn(tf.range(shape_list(first)[0]), first, tf.fill(tf.shape(first), cache_index))
    return through_blocks(model, X, padded_positions(X, cache_index, pad), attend, cache, layouts, table)


def padded_mask(nd, ns, *, dtype, offset=None, pad=None):
    """`model.attention_mask` for rows left-padded by `pad` [batch] slots: each row's padding
    keys masked too, as [batch, nd, ns] (the model's own mask where `pad` is None)."""
    m = attention_mask(nd, ns, dtype=tf.bool, offset=offset)
    if pad is not None:
        m = tf.logical_and(m[None], (tf.range(ns)[None, :] >= pad[:, None])[:, None, :])
    return tf.cast(m, dtype)


def padded_positions(tokens, past_length, pad):
    """`model.positions_for`, each row counted from its first real token where `pad` [batch]
    (its left-padding slots) is given; padding slots get position 0, and are masked anyway."""
    positions = positions_for(tokens, past_length)
    return positions if pad is None else tf.maximum(positions - tf.cast(pad, tf.int32)[:, None], 0)


def call_with_slots(model, X, cache, start, *, window, slot=None, layouts=None, head=None, every_position=False):
    """X [rows, T] through the blocks over a cache of slots (`slot_cache`): row r's tokens sit
    at positions start[r], start[r] + 1, ... of its slot (slot r, of the first `rows` slots, or
    slot[r] with `slot` [rows]), their keys and values written there, and attend to the slot's
    first `window` positions (a Python int; its blocks are read whole) up to their own. A slot's
    keys past the position being written are never read, so a slot is reused without clearing it.
    `head`: a 16-bit model's `wte` (or `out_head`) as a float32 copy (`layouts.head`), or None.
    One new position for each of fewer rows than the slots, with the row kernels' layouts
    (`layouts.rows`): the keys and values written and attended by the kernel
    (`kernels.cached_attention`), in place and only the positions attended, where XLA's
    products would read a copy of the rows' part of each block, after a scatter per block (over
    all the slots, XLA reads the blocks in place).

    Returns the logits of the last position [rows, n_vocab] (of every position [rows, T,
    n_vocab] with `every_position`) and the updated cache. Positions past the window's blocks
    are not written (XLA drops such updates) and are not checked here."""
    hp = model.hparams
    blocks = blocks_for(window)
    positions = start[:, None] + tf.range(shape_list(X)[1])
    mask = tf.cast(positions[:, :, None] >= tf.range(blocks * BLOCK), model.compute_dtype)  # [rows, T, positions]
    rows = tf.range(shape_list(X)[0]) if slot is None else slot
    rows = tf.reshape(rows[:, None] * hp.n_head + tf.range(hp.n_head), [-1])  # the cache rows of each head
    at = tf.reshape(tf.repeat(positions, hp.n_head, axis=0), [-1])  # each new key's position
    by_kernel = X.shape[1] == 1 and by_rows(layouts) and X.shape[0] * hp.n_head < cache[0][0][0].shape[0]  # < slots

    def write(old, new):  # old: a layer's blocks; new [rows * heads, T, head_dim]
        stored, row = list(old), tf.repeat(rows, shape_list(new)[1])
        values = tf.cast(tf.reshape(new, [-1, shape_list(new)[2]]), old[0].dtype)  # as the blocks hold them
        for j in range(blocks):
            offset = at - j * BLOCK
            offset = tf.where((offset >= 0) & (offset < BLOCK), offset, BLOCK)  # past the block: dropped
            stored[j] = tf.tensor_scatter_nd_update(old[j], tf.stack([row, offset], axis=1), values)
        read = [b[:shape_list(new)[0]] if slot is None else tf.gather(b, rows) for b in stored[:blocks]]
        return tuple(stored), read
    attend = by_kernel_attn(rows, tf.zeros_like(at), at) if by_kernel else masked(mask, write)
    return through_blocks(model, X, positions, attend, cache, layouts, head=head, every_position=every_position)


def masked(mask, write):
    """`attend(q, k, v, cache, tf32)` for `through_blocks`: the new keys and values stored by
    `write(old, new)` (which gives (the stored cache, what attention reads: a list of blocks)),
    then `cached_attn` under `mask`."""
    def attend(q, k, v, cache, tf32):
        (k_cache, k_read), (v_cache, v_read) = write(cache[0], k), write(cache[1], v)
        return cached_attn(q, k_read, v_read, mask, tf32=tf32), (k_cache, v_cache)
    return attend


def by_kernel_attn(rows, first, last):
    """`attend(q, k, v, cache, tf32)` for `through_blocks` of one new position per row, by the
    kernel (`kernels.cached_attention`), which writes the new keys and values at `last` and
    attends from `first` to `last` in the cache rows `rows` (each [batch * heads]): q [batch,
    heads, 1, head_dim]; a layer's cache one buffer or a tuple of blocks for each of keys and
    values."""
    def attend(q, k, v, cache, tf32):
        features = shape_list(q)[3]
        scale = tf.math.rsqrt(tf.cast(features, tf.float32))  # as `model.attn_probs` scales
        new = (tf.cast(tf.reshape(t, [-1, features]), tf.float32) for t in (k, v))
        a, k_cache, v_cache = kernels.cached_attention(tf.reshape(q, [-1, features]), rows, first, last, *new,
                                                       tf.nest.flatten(cache[0]), tf.nest.flatten(cache[1]), scale)
        return tf.reshape(a, shape_list(q)), tuple(tf.nest.pack_sequence_as(held, list(written))
                                                   for held, written in zip(cache, (k_cache, v_cache)))
    return attend


def through_blocks(model, X, positions, attend, cache, layouts, table=None, *, head=None, every_position=False):
    """The embeddings of X at `positions`, the blocks over `cache` (`attend(q, k, v, cache,
    tf32)` stores a layer's new keys and values [batch * heads, T, head_dim] in its cache and
    gives (q's attention over it, the stored cache): `masked`, `by_kernel_attn`), then the
    logits of the last position, or of every one: ([batch, n_vocab] or [batch, T, n_vocab], the
    updated cache). `head`: as `call_with_slots`'s."""
    embed, logits = table or ((lambda X: gather_rows(model.as_compute(model.wte), X)), model.lm_logits)
    if table is None and by_rows(layouts):
        logits = lambda h: rows_logits(model, h)
    elif table is None and layouts and model.compute_dtype != "float32" and not tf.executing_eagerly():
        logits = lambda h: held_logits(model, h, head)
    if table is None and head is not None and model.tie_embeddings:
        # XLA's CPU backend gathers a 16-bit row from a float32 copy of all of wte, made at each call
        embed = lambda X: tf.cast(tf.gather(head, X), model.compute_dtype)
    h = embed(X) + gather_rows(model.as_compute(model.wpe), positions)
    new_cache = []
    for block, layer_cache, layout in zip(model.h, cache, layouts or [(None,) * 4] * len(model.h)):
        h, layer_cache = block_with_cache(block, h, attend, layer_cache, layout)
        new_cache.append(layer_cache)
    return (logits(h) if every_position else logits(h[:, -1:])[:, 0]), new_cache


def gather_rows(table, ids):
    """`tf.gather(table, ids)`; a 16-bit table's rows gathered as their bits: XLA's CPU backend
    gathers 16-bit floats from a float32 copy of the whole table, made at each call (154 MB for
    124M's wte); it copies the bits (half the bytes) in a third of that time. A server's steps
    gather from `layouts.head` instead, made once."""
    if table.dtype.size != 2:
        return tf.gather(table, ids)
    return tf.bitcast(tf.gather(tf.bitcast(table, tf.uint16), ids), table.dtype)


def held_logits(model, h, head=None):
    """`model.lm_logits(h)` of a 16-bit model. At one row, its 16-bit weight read at each call:
    XLA's CPU backend multiplies it within one fused loop over the 16-bit values, but in a loop
    it hoists their float32 copy out of it and reads that (twice the bytes) at every step; the
    barrier, tied to h, keeps the conversion in the loop, where it fuses into the product (on
    124M, a tenth of a bfloat16 step). At more rows, `head` (its float32 copy, the same
    numbers) where given: XLA would convert the 16-bit weight at each call (on 124M at 16
    rows, a product of twice the copy's time)."""
    if h.shape[0] != 1 or h.shape[1] != 1:  # static shapes: None where unknown
        return model.lm_logits(h, head)
    return model.lm_logits(h, xla.optimization_barrier(model.as_compute(model.output_weight()), h)[0])


def rows_logits(model, h):
    """`model.lm_logits(h)` of a step's few rows by the row kernels (`layouts.rows`): the output
    weight read as held, in float32 or 16 bits, or an int8 model's int8 copy of it."""
    batch, sequence, _ = shape_list(h)
    h = tf.reshape(model.ln_f(h), [batch * sequence, model.hparams.n_embd])
    if model.logits_int8 is not None:
        logits = model.int8_logits(h, lambda q: kernels.row_product(q, model.logits_int8))
    else:
        wte = model.as_compute(model.output_weight())
        logits = tf.cast(kernels.row_product(tf.cast(h, wte.dtype), wte), h.dtype)  # in the compute dtype
    return tf.reshape(tf.cast(logits, tf.float32), [batch, sequence, -1])


def block_with_cache(block, x, attend, cache, layout):
    """`Block.call` over the cache, its keys and values stored by `attend` (`through_blocks`): (x
    after the block, the updated (keys, values)). Named as the layers (`h0/attn/...`), for
    profiles."""
    attn, mlp = block.attn, block.mlp
    with tf.name_scope(block.name), tf.name_scope(attn.name):
        c = project(attn.c_attn, block.ln_1(x), layout[0])
        q, k, v = map(attn.split_heads, tf.split(c, 3, axis=2))
        a, cache = attend(q, *(tf.reshape(new, [-1] + shape_list(new)[2:]) for new in (k, v)), cache, attn.tf32)
        a = project(attn.c_proj, attn.merge_heads(a), layout[1])
    x = x + a
    with tf.name_scope(block.name), tf.name_scope(mlp.name):
        m = project(mlp.c_proj, gelu(project(mlp.c_fc, block.ln_2(x), layout[2])), layout[3])
    return x + m, cache


def project(conv, x, layout):
    """`conv(x)`, the weight multiplied as `layout` says: None, the layer as it is; an int k
    (one row only), k products over slices of nx; a one-tuple (w,), the weight as a float32 copy
    [nx, nf]; a tensor [nf, nx], the weight copied so (in 16 bits: one row only); `Rows`, a
    weight [nf, nx] read by the row kernels (a few rows; an int8 layer's own weight, its input
    quantized as the layer does); `Columns`, a float32 layer's own weight [nx, nf] read by the
    column kernel (a few rows)."""
    if layout is None:
        return conv(x)
    with tf.name_scope(conv.name):  # named as the layer's own product, for profiles
        *start, nx = shape_list(x)
        x = tf.reshape(x, [-1, nx])
        w = tf.cast(conv.w, x.dtype)
        if isinstance(layout, Rows) and conv.quantization_mode == "int8":
            y = conv.int8_product(x, lambda q: kernels.row_product(q, layout.w))
        elif isinstance(layout, Rows) and x.dtype == tf.bfloat16 and not conv.lora_enabled:
            # the bias added in the kernel: XLA would split the next operation (GELU) between the
            # cores, which costs more than the operation where its threads were asleep
            return tf.reshape(kernels.biased_row_product(x, layout.w, tf.cast(conv.b, x.dtype)), start + [conv.nf])
        elif isinstance(layout, Rows):
            y = tf.cast(kernels.row_product(x, layout.w), x.dtype)
        elif isinstance(layout, Columns):
            y = kernels.column_product(x, layout.w)
        elif isinstance(layout, int) and x.shape[0] == 1 and nx % layout == 0:
            # At a few rows XLA on a CPU runs x @ w on one core; a batched product (w as
            # [k, nx / k, nf], the same memory) runs on all of them, without a copy.
            parts = tf.transpose(tf.reshape(x, [1, layout, nx // layout]), [1, 0, 2])
            y = tf.reduce_sum(matmul(parts, tf.reshape(w, [layout, nx // layout, conv.nf]), tf32=conv.tf32), 0)
        elif isinstance(layout, int):
            y = matmul(x, tf.reshape(w, [-1, conv.nf]), tf32=conv.tf32)
        elif isinstance(layout, tuple):
            # the layer's weight as a float32 copy (`layouts.widened`): a 16-bit model's product, as
            # XLA multiplies it, without converting the weight inside the program
            y = tf.cast(matmul(tf.cast(x, tf.float32), layout[0], tf32=conv.tf32), x.dtype)
        elif layout.dtype != tf.float32 and x.shape[0] == 1:
            # x @ w_t^T at one row, from a 16-bit copy (`layouts.transposed`), tied to x by the
            # barrier: XLA converts it within the product's loop, not once into a float32 copy
            # hoisted out of the decoding loop and read (twice the bytes) at every step
            y = matmul(x, xla.optimization_barrier(layout, x)[0], transpose_b=True, tf32=conv.tf32)
        else:
            # (w_t @ x^T)^T: on all cores at any few rows, from a copy of the weight (float32,
            # `layouts.transposed`). The barrier keeps XLA from rewriting it back into x @ w.
            y = matmul(layout, tf.cast(x, layout.dtype), transpose_b=True, tf32=conv.tf32)
            y = tf.cast(tf.transpose(xla.optimization_barrier(y)[0]), x.dtype)
        if conv.lora_enabled:  # LoRA adapters (`Conv1D.enable_lora`), not merged
            y += conv.lora_output(x)
        return tf.reshape(y + tf.cast(conv.b, x.dtype), start + [conv.nf])


def write_cache(cache, update, index):
    """cache[:, index:index+n] = update, for cache [batch * heads, T, features]; under XLA in
    place in the loop's buffer."""
    return xla.dynamic_update_slice(cache, update, tf.stack([0, index, 0]))


def cached_attn(q, k, v, mask, *, tf32=False):
    """`multihead_attn` over the cache: q [batch, heads, n, features], k and v lists of blocks
    [batch * heads, T_j, features] (the positions in order). The products read the cache as it
    is: a reshape or slice of it between its update and a product makes XLA copy it. Blocks held
    wider than q (a 16-bit model's slots: `slot_dtype`) are multiplied at their dtype, q and the
    probabilities widened, each product rounded to q's dtype: the numbers of q's own products,
    which XLA's CPU backend runs in float32."""
    batch, heads, n, features = shape_list(q)
    q = tf.reshape(q, [batch * heads, n, features])
    held = k[0].dtype
    q_held = tf.cast(q, held)
    w = tf.concat([tf.cast(matmul(q_held, block, transpose_b=True, tf32=tf32), q.dtype) for block in k], axis=-1)
    w = attn_probs(tf.reshape(w, [batch, heads, n, -1]), mask, features)
    parts = tf.split(tf.reshape(w, [batch * heads, n, -1]), [shape_list(block)[1] for block in v], axis=-1)
    a = tf.add_n([tf.cast(matmul(tf.cast(part, held), block, tf32=tf32), q.dtype) for part, block in zip(parts, v)])
    return tf.reshape(a, [batch, heads, n, features])
