"""TensorFlow's checkpoint files (the "tensor bundle") read in row blocks.

TensorFlow's own reader (`RestoreV2`) returns a tensor whole, and its allocator keeps that
buffer afterwards: a bfloat16 model loaded through it holds the float32 `wte` as well. This
reader finds each tensor in the data file and yields it a block of rows at a time, checking
its CRC32C as TensorFlow does, so loading costs the model plus one block.

`<prefix>.index` is a LevelDB table, uncompressed as TensorFlow writes it: each key is a
tensor name, each value a serialized `BundleEntryProto` (dtype, shape, shard, offset, size,
masked CRC32C); the empty key holds the `BundleHeaderProto` (number of shards, endianness).
"""
import google_crc32c
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import tensor_bundle_pb2

MAGIC = 0xdb4775248b80fb57  # the last 8 bytes of a LevelDB table
FOOTER = 48                 # two block handles padded to 40 bytes, then the magic number
BLOCK_BYTES = 2 << 20       # what `row_blocks` reads at a time (whole rows, at least one)


class BundleError(ValueError):
    """A checkpoint file that is not what its index says."""


def masked_crc32c(crc):
    """TensorFlow's masked CRC32C (stored in place of a CRC in CRC-checked data)."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf, pos):
    value = shift = 0
    while True:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _handle(buf, pos=0):
    """A block handle: (offset, size) of a block in the table file, and the position after it."""
    offset, pos = _varint(buf, pos)
    size, pos = _varint(buf, pos)
    return offset, size, pos


def _block(table, offset, size):
    """The (key, value) pairs of one table block, after checking its trailer (type, CRC)."""
    if offset + size + 5 > len(table):
        raise BundleError("a block runs past the end of the file")
    block, kind, crc = table[offset:offset + size], table[offset + size], table[offset + size + 1:offset + size + 5]
    if kind != 0:
        raise BundleError(f"compressed block (type {kind}); TensorFlow writes checkpoint indexes uncompressed")
    if masked_crc32c(google_crc32c.value(table[offset:offset + size + 1])) != int.from_bytes(crc, "little"):
        raise BundleError("a block's checksum does not match (corrupt file?)")
    restarts = int.from_bytes(block[-4:], "little")
    end, pos, key = len(block) - 4 * (restarts + 1), 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        yield key, block[pos:pos + length]
        pos += length


def read_index(prefix):
    """(header, {name: BundleEntryProto}) from `<prefix>.index`."""
    path = prefix + ".index"
    with open(path, "rb") as f:
        table = f.read()
    try:
        if len(table) < FOOTER or int.from_bytes(table[-8:], "little") != MAGIC:
            raise BundleError("not a TensorFlow checkpoint index (no table footer)")
        _, _, pos = _handle(table, len(table) - FOOTER)  # the meta-index block: unused
        index_offset, index_size, _ = _handle(table, pos)
        values = {}
        for _, handle in _block(table, index_offset, index_size):
            offset, size, _ = _handle(handle)
            values.update((key.decode("utf-8"), value) for key, value in _block(table, offset, size))
        header = tensor_bundle_pb2.BundleHeaderProto.FromString(values.pop(""))
        entries = {name: tensor_bundle_pb2.BundleEntryProto.FromString(v) for name, v in values.items()}
    except (IndexError, KeyError, UnicodeDecodeError, ValueError) as e:  # protobuf's DecodeError is a ValueError
        raise BundleError(f"{path}: {e}") from None
    if header.endianness != tensor_bundle_pb2.BundleHeaderProto.LITTLE:
        raise BundleError(f"{path}: a big-endian checkpoint; only little-endian ones are read")
    return header, entries


def data_file(prefix, header, entry):
    return f"{prefix}.data-{entry.shard_id:05d}-of-{header.num_shards:05d}"


def row_blocks(prefix, header, entry):
    """Yield (indices, rows) over a tensor in blocks of about BLOCK_BYTES, by rows along its
    first axis longer than 1 (so [1, nx, nf] goes by rows of nf): `rows` [n, ...] and their
    `indices` [n, axis + 1] in the tensor, as `ResourceScatterNdUpdate` takes them. Then checks
    the whole tensor's CRC32C. Raises BundleError naming the file when the data file is short
    or the checksum does not match."""
    dtype = np.dtype(tf.as_dtype(entry.dtype).as_numpy_dtype)
    shape = [d.size for d in entry.shape.dim]
    if entry.slices or not shape:
        raise BundleError(f"{prefix}.index: a partitioned or scalar tensor (shape {shape}) is not read here")
    if dtype.itemsize * int(np.prod(shape)) != entry.size:
        raise BundleError(f"{prefix}.index: size {entry.size} does not fit shape {shape} of {dtype.name}")
    axis = next((i for i, n in enumerate(shape) if n != 1), 0)
    row = shape[axis + 1:]
    per_block = max(1, BLOCK_BYTES // max(dtype.itemsize * int(np.prod(row)), 1))
    path, crc = data_file(prefix, header, entry), 0
    with open(path, "rb") as f:
        f.seek(entry.offset)
        for start in range(0, shape[axis], per_block):
            block = np.empty([min(per_block, shape[axis] - start)] + row, dtype)
            raw = block.reshape(-1).view(np.uint8)
            if f.readinto(raw) != block.nbytes:
                raise BundleError(f"{path}: ends inside a tensor (truncated file?)")
            crc = google_crc32c.extend(crc, raw)
            indices = np.zeros([len(block), axis + 1], np.int64)
            indices[:, axis] = np.arange(start, start + len(block))
            yield indices, block
    if masked_crc32c(crc) != entry.crc32c:
        raise BundleError(f"{path}: a tensor's checksum does not match (corrupt file?)")
