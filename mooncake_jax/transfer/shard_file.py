"""The bytes of one shard file of the SSD tier's data array, as TensorStore's zarr3 ``sharding_indexed`` codec
reads them: a shard index at the start of the file, then each slot's record data as one raw inner chunk.

Why the tier lays these bytes out itself (``shard_writer.py`` writes them): TensorStore's file kvstore writes a
value only by copying it into its own buffers first (the chunk encoder's copy, then ``writev`` of 64 KiB Cord
blocks), and its ``file_io_mode`` ``direct`` applies to reads only (tensorstore ``kvstore/file/schema.yml``), so
through TensorStore an SSD put costs two copies where a raw write costs one (docs/benchmarks/pool.md). The array stays
TensorStore's: it creates and opens it, reads the heads on open, rewrites them and deletes shards (the tier reads
the records itself, at offsets its index gives: ``chunk_offsets``, ``shard_reader.py``); a shard file laid
out here is byte for byte one that TensorStore reads (tested by reading it back through TensorStore, which checks
the index's CRC32C).

Index (``index_codecs`` ``bytes`` little-endian, then ``crc32c``): one ``(offset, nbytes)`` pair of u64 per slot of
the shard, in slot order, ``(2**64-1, 2**64-1)`` for a slot without a chunk, then the CRC32C (Castagnoli) of those
bytes as a u32. The zarr3 sharding format lets chunks sit anywhere after the index, so the data may start at
``data_start`` (past padding that aligns it to a page: direct I/O needs it, buffered writes and reads of whole pages
cost less) instead of right behind the index.
"""

from __future__ import annotations

import functools

import numpy as np

NO_CHUNK = (1 << 64) - 1
INDEX_ENTRY_BYTES = 16
CRC_BYTES = 4


def _crc32c_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0x82F63B78), table >> 1).astype(np.uint32)
    return table


_TABLE = [int(v) for v in _crc32c_table()]


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, as iSCSI and zarr3's ``crc32c`` codec) of ``data``. Byte by byte in Python: it runs
    over one shard index (about a KiB) per shard file written, never over block data."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def index_bytes(slots: int) -> int:
    """Bytes of the shard index of a shard of ``slots`` slots (entries and CRC)."""
    return INDEX_ENTRY_BYTES * slots + CRC_BYTES


def data_start(slots: int, align: int) -> int:
    """Where the first chunk starts: right past the index, rounded up to a multiple of ``align``."""
    return -(-index_bytes(slots) // align) * align


@functools.lru_cache(maxsize=256)
def encode_index(slots: int, start: int, chunk_bytes: int, filled: int) -> bytes:
    """The shard index of a shard whose first ``filled`` slots hold chunks of ``chunk_bytes`` bytes laid end to
    end from ``start``; the other slots hold none. Cached: a store's calls write the same few indexes again and
    again, and the CRC in Python costs about 0.4 ms per KiB of index."""
    entries = np.full((slots, 2), NO_CHUNK, np.dtype("<u8"))
    entries[:filled, 0] = start + chunk_bytes * np.arange(filled, dtype=np.uint64)
    entries[:filled, 1] = chunk_bytes
    raw = entries.tobytes()
    return raw + crc32c(raw).to_bytes(CRC_BYTES, "little")


def chunk_offsets(index: bytes, slots: int, chunk_bytes: int) -> np.ndarray | None:
    """Where each slot's chunk starts in a shard file (int64, -1 for a slot without a chunk) by its index; None
    for an index cut short, failing its CRC, or listing a chunk of another size. The tier reads records at these
    offsets (``shard_reader.py``): a shard TensorStore rewrote may hold its chunks in any order."""
    if len(index) < index_bytes(slots):
        return None
    raw = index[: INDEX_ENTRY_BYTES * slots]
    if int.from_bytes(index[len(raw) : len(raw) + CRC_BYTES], "little") != crc32c(raw):
        return None
    entries = np.frombuffer(raw, np.dtype("<u8")).reshape(slots, 2)
    held = entries[:, 0] != NO_CHUNK
    if np.any(entries[held, 1] != chunk_bytes):
        return None
    offsets = np.full(slots, -1, np.int64)
    offsets[held] = entries[held, 0]
    return offsets
