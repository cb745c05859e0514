"""Writing the SSD tier's data shard files behind the caller, on one writer thread, in the layout of
``shard_file.py`` (what TensorStore's zarr3 sharding reads).

Two ways, chosen per store (``FileStore(direct_io=...)``), measured side by side in docs/benchmarks/pool.md:

* **buffered** (the default): a shard's blocks are hashed where they lie and written by ``pwritev`` straight
  from the caller's arrays (untouched until written), blocks under 1 MiB grouped by about 1 MiB (handed over
  before they are hashed), larger ones by 4 MiB, then the index: the kernel's copy into the page cache is the only
  copy, as in a raw ``write`` of the same bytes, and a block read back soon comes from the page cache. A shard may
  be written in steps (``finish`` with ``close=False``), each step's blocks before the index that lists them. (On
  the caller's thread instead, as a raw ``write`` is, the put ran slower: eighth pass in docs/benchmarks/pool.md.)
* **direct** (``O_DIRECT``): a shard's blocks are copied and hashed in one pass into a bounded ring of
  page-aligned pieces (``PIECE_BYTES`` each, ``PIECES`` of them), and each full piece is written by the thread
  while the next one fills, so the copy overlaps the device's write and the page cache is neither used nor
  throttled (``O_DIRECT`` needs offsets, lengths and buffers aligned: the data starts one page into the file and
  the last piece is padded, then the file is cut to its exact size). A filesystem that refuses ``O_DIRECT``
  (EINVAL) gets the same bytes written buffered, with one log line.

Durability: no fsync, and a shard kept open across calls has its index and heads file rewritten in place as it
grows (TensorStore replaced a heads file whole). "On disk" when a call returns means in the page cache. A torn or
missing write fails the checksum in the record's head when read, and a torn index fails its CRC32C: a heads shard
that fails it drops every record of that shard (up to a whole shard's) when the tier opens.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from mooncake_jax.transfer.checksum import COPY_CHUNK_BYTES, checksum, split_digest
from mooncake_jax.transfer.shard_file import data_start, encode_index, index_bytes

log = logging.getLogger(__name__)

ALIGN = 4096
"""Direct I/O alignment of file offsets, lengths and buffer addresses (a page: what every Linux filesystem
accepts)."""
PIECE_BYTES = 4 << 20
"""Bytes per write handed to the thread (direct: one aligned piece; buffered: blocks of 1-4 MiB grouped up to this,
a large block handed over by this much): large enough that the device sees long sequential writes and the thread is
woken seldom, small enough that the caller's work on the next piece overlaps the write of this one."""
HAND_OFF_BYTES = 1 << 20
"""Buffered: blocks smaller than this are handed to the thread once about this many bytes of them have gathered
(three 16-token blocks of the ``small`` preset), before they are hashed: the thread starts writing a call's first
blocks while the caller hashes them and the next ones, where a 4 MiB piece kept it idle until eleven 16-token blocks
were hashed (a third of the raw write's time for a 16-block call, on an idle core). Larger blocks go by
``PIECE_BYTES`` as before: handing 128-token blocks (3 MiB) over one by one cost more CPU in an A/B (eighth pass)."""
PIECES = 4
"""Direct pieces being filled or written at once: the write-behind bound (16 MiB of staging per store)."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _no_digest(data: np.ndarray) -> None:
    """What ``append(..., digest=False)`` takes instead of hashing."""


def aligned_buffer(size: int) -> np.ndarray:
    """A zeroed, page-aligned uint8 buffer of ``size`` bytes (an anonymous mapping, freed with the array)."""
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), np.uint8)[:size]


def _takes_direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` open with ``O_DIRECT`` (tmpfs and some others refuse it: EINVAL)."""
    probe = directory / ".direct-io-probe"
    try:  # opened and written: some filesystems take the flag at open and refuse the aligned write (EINVAL)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | _O_DIRECT, 0o644)
        try:
            os.pwrite(fd, aligned_buffer(ALIGN), 0)
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        log.warning("ssd tier: %s refuses O_DIRECT; its shards are written through the page cache", directory)
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def _write_all(fd: int, buffers: list, offset: int) -> None:
    """``pwritev`` every byte of ``buffers`` at ``offset`` (a regular file may take fewer bytes per call)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.pwritev(fd, views[:1024], offset)  # IOV_MAX
        if not written:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class ShardWriter:
    """The writer thread of one SSD store and, in direct mode, its ring of aligned pieces."""

    def __init__(self, directory: Path, direct: bool) -> None:
        self.direct = direct and bool(_O_DIRECT) and _takes_direct_io(directory)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ssd-shard-writer")
        self._pieces = [aligned_buffer(PIECE_BYTES) for _ in range(PIECES)] if self.direct else []
        self._piece_done: list[Future | None] = [None] * len(self._pieces)
        self._next_piece = 0

    def open(self, path: Path, slots: int, chunk_bytes: int) -> ShardImage:
        """Start the shard file ``path`` of ``slots`` slots whose chunks are ``chunk_bytes`` each (with ``O_DIRECT``
        where the writer writes so); the file is created on the writer thread (about a millisecond on a busy
        ext4)."""
        return ShardImage(self, path, slots, chunk_bytes, self.direct)

    def submit(self, job: Callable[[], object]) -> Future:
        return self._thread.submit(job)

    def write_rows(self, path: Path, slots: int, rows: np.ndarray) -> Future:
        """Write in place, behind the caller, the shard file ``path`` of ``slots`` slots whose first ``len(rows)``
        slots hold the ``rows`` (2-D uint8, a chunk per row, untouched from now on): the rows, then the index (one
        page), so rewriting a shard that gained rows keeps the rows it listed before readable at every moment."""
        start = index_bytes(slots)
        index = encode_index(slots, start, rows.shape[1], len(rows))

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, [rows], start)
                _write_all(fd, [index], 0)
            finally:
                os.close(fd)

        return self.submit(write)

    def take_piece(self) -> tuple[int, np.ndarray]:
        """The next piece of the ring, once the write of what it last held is done (the write-behind bound)."""
        index = self._next_piece
        self._next_piece = (index + 1) % len(self._pieces)
        done = self._piece_done[index]
        if done is not None:
            done.exception()  # its failure is the shard's, reported when that shard finishes
        return index, self._pieces[index]

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class ShardImage:
    """One data shard file being written: blocks appended in slot order, then ``finish``."""

    def __init__(self, writer: ShardWriter, path: Path, slots: int, chunk_bytes: int, direct: bool) -> None:
        self._writer = writer
        self._path = path
        self._fd: list[int] = []  # the file, once the writer thread has created it
        self._slots = slots
        self._chunk_bytes = chunk_bytes
        self._direct = direct
        # page-aligned in both modes: direct I/O needs it, and a buffered block of whole pages is written (and read
        # back) page by page as a raw write of the same bytes is, instead of touching one partial page more
        self._start = data_start(slots, ALIGN)
        self._filled = 0
        self._chunks: list[np.ndarray] = []  # buffered: parts of blocks not yet handed to the thread
        self._chunks_bytes = 0
        self._piece: tuple[int, np.ndarray] | None = None  # direct: the piece being filled, and how far
        self._piece_fill = 0
        self._offset = self._start  # where the next write handed to the thread goes
        self._errors: list[BaseException] = []
        self._created = writer.submit(self._create)

    @property
    def start(self) -> int:
        """Where the first chunk starts in the file; chunk ``i`` starts ``i * chunk_bytes`` after it."""
        return self._start

    def _create(self) -> None:
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (_O_DIRECT if self._direct else 0)
            self._fd.append(os.open(self._path, flags, 0o644))
        except BaseException as err:
            self._errors.append(err)
            raise

    def append(self, data: np.ndarray, digest: bool = True, now: bool = False) -> tuple[int, int] | None:
        """Add the next slot's chunk (flat uint8 of ``chunk_bytes``); its checksum (None with ``digest=False``: a
        record whose head already carries it, demoted from DRAM or received and checked, is not hashed again).
        Buffered, ``data`` is written from where it lies, so it must stay untouched until the shard is finished, or
        (``now``: a DRAM slot refilled as soon as its block is demoted) it is written on the caller's thread before
        this returns, instead of being copied for the writer thread; direct, it is copied here."""
        if data.size != self._chunk_bytes:
            raise ValueError(f"chunk of {data.size} bytes, expected {self._chunk_bytes}")
        if not self._direct and now:
            return self._append_now(data, digest)
        if not self._direct:
            return self._append_in_place(data, digest)
        hasher = xxhash.xxh3_128() if digest else None
        pos, n = 0, data.size
        while pos < n:
            if self._piece is None:
                self._piece, self._piece_fill = self._writer.take_piece(), 0
            piece = self._piece[1]
            take = min(n - pos, PIECE_BYTES - self._piece_fill, COPY_CHUNK_BYTES)
            dst = piece[self._piece_fill : self._piece_fill + take]
            np.copyto(dst, data[pos : pos + take])
            if hasher is not None:
                hasher.update(dst)
            pos += take
            self._piece_fill += take
            if self._piece_fill == PIECE_BYTES:
                self._write_piece()
        self._filled += 1
        return None if hasher is None else split_digest(hasher.intdigest())

    def _append_now(self, data: np.ndarray, digest: bool) -> tuple[int, int] | None:
        """Buffered, written before this returns: the blocks handed over before it go to the thread first (they
        lie before it in the file), then ``data`` by ``pwritev`` here, straight from where it lies. A failure is the
        shard's, reported when it finishes, as a failed write on the thread is."""
        found = checksum(data) if digest else None
        if self._chunks:
            self._write_chunks()
        self._created.exception()  # the file is created on the writer thread
        if not self._errors:
            try:
                _write_all(self._fd[0], [data], self._offset)
            except BaseException as err:
                self._errors.append(err)
        self._offset += data.size
        self._filled += 1
        return found

    def _append_in_place(self, data: np.ndarray, digest: bool = True) -> tuple[int, int] | None:
        """Buffered: hash ``data`` where it lies and hand it to the thread by ``PIECE_BYTES`` (several blocks to one
        ``pwritev``), so the kernel's copy of one piece runs beside the hashing of the next; blocks under
        ``HAND_OFF_BYTES`` are handed over by about that much, each before it is hashed (XXH3 releases the GIL),
        so the thread starts on a call's first blocks while the caller hashes them."""
        hash_of = checksum if digest else _no_digest
        if data.size < HAND_OFF_BYTES:
            self._chunks.append(data)
            self._chunks_bytes += data.size
            if self._chunks_bytes >= HAND_OFF_BYTES:
                self._write_chunks()
            found = hash_of(data)
        elif data.size <= PIECE_BYTES:
            found = hash_of(data)
            self._chunks.append(data)
            self._chunks_bytes += data.size
        else:
            hasher = xxhash.xxh3_128() if digest else None
            for start in range(0, data.size, PIECE_BYTES):
                part = data[start : start + PIECE_BYTES]
                if hasher is not None:
                    hasher.update(part)
                self._chunks.append(part)
                self._chunks_bytes += part.size
                if self._chunks_bytes >= PIECE_BYTES:
                    self._write_chunks()
            found = None if hasher is None else split_digest(hasher.intdigest())
        if self._chunks_bytes >= PIECE_BYTES:
            self._write_chunks()
        self._filled += 1
        return found

    def _write_chunks(self) -> None:
        self._submit_write(self._chunks, self._offset)
        self._offset += self._chunks_bytes
        self._chunks, self._chunks_bytes = [], 0

    def _submit_write(self, buffers: list, offset: int) -> Future:
        errors = self._errors

        def write() -> None:
            if errors:
                return  # the shard failed already: reported when it finishes
            try:
                _write_all(self._fd[0], buffers, offset)
            except BaseException as err:
                errors.append(err)
                raise

        return self._writer.submit(write)

    def _write_piece(self) -> None:
        index, piece = self._piece
        length = -(-self._piece_fill // ALIGN) * ALIGN
        self._writer._piece_done[index] = self._submit_write([piece[:length]], self._offset)
        self._offset += length
        self._piece = None

    def finish(self, close: bool = True) -> Future:
        """Write the rest and the index behind the caller and close the file; the future raises what failed.
        Buffered, ``close=False`` keeps the shard open for more blocks: what was appended is written, then the
        index, written again next time (a shard's first write is its index and blocks in one ``pwritev``, index
        first; no reader looks at a shard before the settle that waits for it)."""
        index = encode_index(self._slots, self._start, self._chunk_bytes, self._filled)
        errors, end = self._errors, self._start + self._filled * self._chunk_bytes
        if self._direct:
            if not close:
                raise ValueError("a direct-I/O shard is finished whole (its last piece is padded)")
            if self._piece is not None:
                self._write_piece()
            head = aligned_buffer(self._start)
            head[: len(index)] = np.frombuffer(index, np.uint8)
            writes = [([head], 0)]
        elif self._offset == self._start:  # nothing handed over yet: index, padding and blocks in one pwritev
            writes = [([index, bytes(self._start - len(index)), *self._chunks], 0)]
        else:
            writes = [(self._chunks, self._offset), ([index], 0)]
        self._offset += self._chunks_bytes
        self._chunks, self._chunks_bytes = [], 0

        def finish() -> None:
            try:
                if errors:
                    raise errors[0]
                for buffers, offset in writes:
                    _write_all(self._fd[0], buffers, offset)
                if self._direct:
                    os.ftruncate(self._fd[0], end)  # the last piece's padding off
            finally:
                if close and self._fd:
                    os.close(self._fd.pop())

        return self._writer.submit(finish)

    def abort(self) -> Future:
        """Close the file without finishing it (its records are all gone); done once the writes before are."""
        self._chunks = []

        def close() -> None:
            if self._fd:
                os.close(self._fd.pop())

        return self._writer.submit(close)
