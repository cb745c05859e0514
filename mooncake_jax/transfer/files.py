"""The SSD tier's storage: one file per block record, written behind the caller by a few writer threads.

Layout: ``<root>/<2 hex digits>/<16 hex digits of the key>``, each file exactly one record (the same bytes as in
DRAM and on the wire). A file is written under a temporary name and renamed into place, so a reader (or a process
restarted after a crash) sees a whole record or none; nothing is fsynced: the checksum in every record, not fsync,
is what keeps a torn or lost write from being served.

Why not TensorStore's file kvstore (what this tier used before): its write takes one joined ``bytes`` (a copy of
the block) and its read returns a fresh ``bytes`` (another copy before the data reaches the caller's buffer), which
held the tier to about 0.4 of a raw file write. Here a write hands the kernel the record head and the caller's
array as they are (``os.write`` of each), on a writer thread, so hashing the next block overlaps the kernel's copy
of this one; a read lands chunk by chunk straight in the caller's staging buffer, each chunk hashed while in cache.

Writes in flight are bounded (``max_in_flight``); ``settle`` waits for all of them and reports the failures. The
pool settles at the end of every call, so buffers it hands to a write stay untouched until the write is done.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import COPY_CHUNK_BYTES, checksum
from mooncake_jax.transfer.frame import DATA_OFFSET, record_bytes, record_head
from mooncake_jax.transfer.spec import BlockSpec

_STORED_NAME = re.compile(r"^[0-9a-f]{16}$")
_FAN_OUT_NAME = re.compile(r"^[0-9a-f]{2}$")
_TEMP_SUFFIX = ".partial"
_LOW = (1 << 64) - 1

Buffer = bytes | bytearray | memoryview | np.ndarray


def _write_all(fd: int, part: Buffer) -> None:
    view = memoryview(part).cast("B") if not isinstance(part, np.ndarray) else memoryview(part.reshape(-1).view(np.uint8))
    while view:
        view = view[os.write(fd, view) :]


class FileStore:
    """Records of one ``BlockSpec`` as files under ``root``."""

    def __init__(self, root: Path, spec: BlockSpec, *, writers: int = 2, max_in_flight: int = 8) -> None:
        self.root = root
        self.spec = spec
        self.record_bytes = record_bytes(spec)
        self.max_in_flight = max_in_flight
        self._executor = ThreadPoolExecutor(writers, thread_name_prefix="ssd-write")
        self._pending: deque[tuple[BlockKey, Future]] = deque()
        self._failed: list[tuple[BlockKey, Exception]] = []
        self._made_dirs: set[str] = set()
        self._temp_names = itertools.count()

    # ---- naming ------------------------------------------------------------------------------------------

    def path_of(self, key: BlockKey) -> Path:
        name = f"{key:016x}"
        return self.root / name[:2] / name

    def listed(self) -> list[BlockKey]:
        """Keys of the records under ``root`` (temporary files of writes a crash cut short are removed)."""
        keys = []
        for fan_out in os.scandir(self.root):
            if not (fan_out.is_dir() and _FAN_OUT_NAME.match(fan_out.name)):
                continue
            for entry in os.scandir(fan_out.path):
                if _STORED_NAME.match(entry.name):
                    keys.append(int(entry.name, 16))
                elif entry.name.endswith(_TEMP_SUFFIX):
                    os.unlink(entry.path)
        return sorted(keys)

    # ---- writes ------------------------------------------------------------------------------------------

    def put_block(self, key: BlockKey, data: np.ndarray) -> None:
        """Store the block whose bytes are ``data`` (flat uint8, untouched until ``settle``)."""
        self.put(key, (record_head(self.spec, key, checksum(data)), data), owned=True)

    def put(self, key: BlockKey, parts: Sequence[Buffer], owned: bool) -> None:
        """Store a record given as consecutive parts. ``owned``: the parts stay untouched until ``settle`` (else
        the write finishes before this returns, e.g. a DRAM slot about to be reused)."""
        while len(self._pending) >= self.max_in_flight:
            self._finish_oldest()
        future = self._executor.submit(self._write_file, key, tuple(parts))
        self._pending.append((key, future))
        if not owned:
            self.settle_quietly()

    def _write_file(self, key: BlockKey, parts: tuple[Buffer, ...]) -> None:
        path = self.path_of(key)
        if path.parent.name not in self._made_dirs:
            path.parent.mkdir(exist_ok=True)
            self._made_dirs.add(path.parent.name)
        temp = path.with_name(f"{path.name}.{os.getpid()}-{next(self._temp_names)}{_TEMP_SUFFIX}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                for part in parts:
                    _write_all(fd, part)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def _finish_oldest(self) -> None:
        key, future = self._pending.popleft()
        try:
            future.result()
        except Exception as err:
            self._failed.append((key, err))

    def settle_quietly(self) -> None:
        while self._pending:
            self._finish_oldest()

    def settle(self) -> list[tuple[BlockKey, Exception]]:
        """Wait for every write in flight; the ``(key, error)`` of those that failed since the last settle."""
        self.settle_quietly()
        failed, self._failed = self._failed, []
        return failed

    def delete(self, key: BlockKey) -> None:
        self.path_of(key).unlink(missing_ok=True)

    # ---- reads -------------------------------------------------------------------------------------------

    def record(self, key: BlockKey) -> bytes | None:
        """The stored file's bytes (unverified), or None if it is gone or unreadable."""
        try:
            return self.path_of(key).read_bytes()
        except OSError:
            return None

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[bytes, tuple[int, int]] | None:
        """Read the record's data straight into ``out`` (flat uint8), hashing each chunk as it lands; its head and
        the checksum of what was read. A file of the wrong size reads as a head that fails its checks."""
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != self.record_bytes:
                return b"", (0, 0)
            head = os.pread(fd, DATA_OFFSET, 0)
            hasher = xxhash.xxh3_128()
            for start in range(0, out.size, COPY_CHUNK_BYTES):
                chunk = out[start : start + COPY_CHUNK_BYTES]
                if os.preadv(fd, [chunk], DATA_OFFSET + start) != chunk.size:
                    return b"", (0, 0)  # cut short under us
                hasher.update(chunk)
        except OSError:
            return None
        finally:
            os.close(fd)
        digest = hasher.intdigest()
        return head, (digest >> 64, digest & _LOW)

    def close(self) -> None:
        self.settle_quietly()
        self._executor.shutdown(wait=True)
