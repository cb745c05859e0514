"""Writing the SSD tier's data shard files in the layout of ``shard_file.py`` (what TensorStore's zarr3 sharding
reads): buffered on the caller's thread, direct behind the caller on one writer thread.

Two ways, chosen per store (``FileStore(direct_io=...)``), measured side by side in docs/benchmarks/pool.md:

* **buffered** (the default): each block is written as it is appended, by ``pwritev`` straight from the
  caller's array (1 MiB at a time, each piece hashed right after from cache: one pass over the caller's memory),
  then the index: the kernel's copy into the page cache is the only copy, as in a raw ``write`` of the same bytes,
  and a block read back soon comes from the page cache. A shard may be written in steps (``finish`` with
  ``close=False``), each step's blocks before the index that lists them. Why on the caller's thread, as a raw
  ``write`` is: on a shared 2-core host a hand-off to a writer thread cost a wake-up (the thread started 0.8-1.5
  ms after it was handed a piece at load 10-20) and CPU, and the caller waited at the end of the call anyway
  (each call's blocks are on disk when it returns); measured in docs/benchmarks/pool.md, eighth pass.
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

from mooncake_jax.transfer.checksum import COPY_CHUNK_BYTES, fill_with_checksum, split_digest
from mooncake_jax.transfer.shard_file import data_start, encode_index, index_bytes

log = logging.getLogger(__name__)

ALIGN = 4096
"""Direct I/O alignment of file offsets, lengths and buffer addresses (a page: what every Linux filesystem
accepts)."""
PIECE_BYTES = 4 << 20
"""Bytes per direct write handed to the thread (one aligned piece): large enough that the device sees long
sequential writes and the thread is woken seldom, small enough that the caller's copy into the next piece overlaps
the write of this one."""
PIECES = 4
"""Direct pieces being filled or written at once: the write-behind bound (16 MiB of staging per store)."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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
    """How one SSD store writes its shard files: on the caller's thread (buffered), or on a writer thread from a ring
    of aligned pieces (direct)."""

    def __init__(self, directory: Path, direct: bool) -> None:
        self.direct = direct and bool(_O_DIRECT) and _takes_direct_io(directory)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ssd-shard-writer")
        self._pieces = [aligned_buffer(PIECE_BYTES) for _ in range(PIECES)] if self.direct else []
        self._piece_done: list[Future | None] = [None] * len(self._pieces)
        self._next_piece = 0

    def open(self, path: Path, slots: int, chunk_bytes: int) -> ShardImage:
        """Start the shard file ``path`` of ``slots`` slots whose chunks are ``chunk_bytes`` each (with ``O_DIRECT``
        where the writer writes so, the file created on the writer thread)."""
        return ShardImage(self, path, slots, chunk_bytes, self.direct)

    def submit(self, job: Callable[[], object]) -> Future:
        """Run ``job`` behind the caller on the writer thread (direct), or now on the caller's (buffered: see the
        module docstring); its future either way."""
        if self.direct:
            return self._thread.submit(job)
        done: Future = Future()
        try:
            done.set_result(job())
        except Exception as err:
            done.set_exception(err)
        return done

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
        self._piece: tuple[int, np.ndarray] | None = None  # direct: the piece being filled, and how far
        self._piece_fill = 0
        self._offset = self._start  # where the next write handed to the thread goes
        self._errors: list[BaseException] = []
        writer.submit(self._create)  # buffered: now; its error, kept, fails the shard when it finishes

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

    def append(self, data: np.ndarray) -> tuple[int, int]:
        """Add the next slot's chunk (flat uint8 of ``chunk_bytes``); its checksum. Buffered, ``data`` is written
        from where it lies before this returns; direct, it is copied into a piece here: either way the caller may
        reuse ``data`` at once."""
        if data.size != self._chunk_bytes:
            raise ValueError(f"chunk of {data.size} bytes, expected {self._chunk_bytes}")
        if not self._direct:
            return self._append_in_place(data)
        hasher = xxhash.xxh3_128()
        pos, n = 0, data.size
        while pos < n:
            if self._piece is None:
                self._piece, self._piece_fill = self._writer.take_piece(), 0
            piece = self._piece[1]
            take = min(n - pos, PIECE_BYTES - self._piece_fill, COPY_CHUNK_BYTES)
            dst = piece[self._piece_fill : self._piece_fill + take]
            np.copyto(dst, data[pos : pos + take])
            hasher.update(dst)
            pos += take
            self._piece_fill += take
            if self._piece_fill == PIECE_BYTES:
                self._write_piece()
        self._filled += 1
        return split_digest(hasher.intdigest())

    def _append_in_place(self, data: np.ndarray) -> tuple[int, int]:
        """Buffered: write ``data`` into its place in the file now, by ``COPY_CHUNK_BYTES`` straight from where it
        lies (the kernel's copy into the page cache is the only copy, as in a raw ``write``), each piece hashed
        right after, from cache: one pass over the caller's memory, no thread hand-off. A write that fails is
        kept, the rest of the shard not written, and raised when the shard finishes."""
        offset, errors = self._offset, self._errors
        self._offset += data.size
        self._filled += 1

        def write(piece: np.ndarray, start: int) -> bool:
            if not errors:
                try:
                    _write_all(self._fd[0], [piece], offset + start)
                except Exception as err:
                    errors.append(err)
            return True  # hashed either way: the head is made, the shard fails at finish

        return fill_with_checksum(data, write)

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
        """Write the rest and the index (direct: behind the caller; buffered: now, after the blocks it lists) and
        close the file; the future raises what failed. Buffered, ``close=False`` keeps the shard open for more
        blocks: the index is written again next time (no reader looks at a shard before the settle that waits for
        it)."""
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
        else:  # buffered: every block is written already
            writes = [([index], 0)]

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

        def close() -> None:
            if self._fd:
                os.close(self._fd.pop())

        return self._writer.submit(close)
