"""Reading the SSD tier's records out of its data shard files: ``preadv`` of each chunk, at the offset the tier
knows, straight into the caller's buffer, hashed (XXH3-128) as it lands.

Why the tier reads its own shards (docs/benchmarks/pool.md, "Issue 15, SSD get and DRAM put, seventh pass"): through
TensorStore a 16-token get cost 0.31-0.40 CPU s/GB (thread hand-offs and chunk decoding, about 0.1 ms per 384 KiB
record beyond the copy) where a raw read of the same bytes cost 0.07-0.10; read here, 0.13-0.20. The tier wrote
every shard itself (``shard_writer.py``), or found its index when it opened the shard (TensorStore may have
rewritten it: the chunks may lie anywhere after the index), so a record's offset is known in memory and a read is
one ``preadv`` per ``READ_STEP_BYTES`` (a record up to ``ONE_READ_BYTES`` in one), each step hashed from the core's
L2 cache right after it lands: the same kernel copy a raw ``read`` makes, plus the hash. The files stay
TensorStore's zarr3 shards (TensorStore still opens, lists and reads them: tested). A location that is wrong (a
shard rewritten behind the tier's back) reads other bytes, which fail the checksum: never served.

A batch read names the runs of chunks it will read (``want``); they are handed to the kernel as
``POSIX_FADV_WILLNEED`` only once a read finds its bytes not in the page cache (``preadv`` with ``RWF_NOWAIT``
comes back short), so a cold batch has its later records read from the device while the first ones are copied and
hashed, and a warm one (the records just written, most gets) pays nothing for it: asking for cached pages cost
about 7% of a 16-token get's CPU.

Records of a batch lying end to end in a shard (a batch written by one call, read back in order) are read a run at
a time (``read_run``, ``RUN_BYTES``): one ``preadv`` into their several destinations, then each hashed; a
``preadv`` and the Python around it cost a share of a 384 KiB record's get (docs/benchmarks/pool.md, nineteenth
pass).

A batch of several runs is read on two threads at once (``read_many``): the caller and one helper thread
(``Helper``) each take the next run not yet taken, read and hash it. ``preadv`` releases the GIL, and so does the
hash: this way calls the library's XXH3-128 through ``ctypes`` (``xxh3_nogil``, which says why and what is not known
about it; the package's call, which releases the GIL itself over 64 KiB, where it cannot be bound), and with a core
free a batch costs about half its copy-and-hash time in wall (a raw read of the same bytes is the copy
alone, one thread). Taking runs in turn, rather than half each, keeps the batch going at the caller's pace when the
helper is late to be scheduled on a loaded machine, and the caller waits at the end for at most the one run the helper
is reading. A helper only pays with a core free for it: with both threads on one busy core (load 12-13 on this
2-core machine) a 16-token batch took 1.27 ms with it against 0.86 ms without (the GIL handed back and forth at every
read and hash). So each batch goes the way that has read faster lately (``Pace``: the median seconds per byte of
each way's last batches, the other way tried every ``Pace.explore_every`` batches, or ``Pace.far_explore_every``
when it is far slower; each way timed warm, a try of the helper two batches: ``ShardReader.read_many``).

Open files are kept in a small LRU (``MAX_OPEN_FILES``): a tier of many shards does not run out of descriptors, and
a deleted shard's descriptor is closed with it (``forget``) so its space is freed at once.
"""

from __future__ import annotations

import errno
import os
import statistics
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from xxhash import xxh3_128, xxh3_128_intdigest

from mooncake_jax.transfer import xxh3_nogil
from mooncake_jax.transfer.checksum import LOW_WORD, Digest, fill_with_checksum, split_digest
from mooncake_jax.transfer.stream_copy import streaming_copy, writable_address

READ_STEP_BYTES = 256 << 10
"""Bytes landed by one ``preadv`` then hashed, for records over ``ONE_READ_BYTES``: small enough that what the
kernel's copy just wrote is still in the core's L2 cache when XXH3 reads it. On the Intel Xeon measured (2 MiB of
L2 a core) the hash cost 0.043-0.047 CPU s/GB after 192-384 KiB reads and 0.075 after 1 MiB ones (the kernel's copy
reads the page cache and writes the destination through L2: 2 MiB of lines for a 1 MiB read), the reads
themselves 0.215-0.226 at every size: a 160 MiB record read and hashed for 0.262 CPU s/GB in 256 KiB steps
against 0.288 in 1 MiB steps (the raw read 0.193), 9 alternated rounds, load 3.7 (docs/benchmarks/pool.md, twelfth
pass)."""
ONE_READ_BYTES = 2 * READ_STEP_BYTES
"""A record up to this size (a 16-token block of the ``small`` preset, 384 KiB) is read by one ``preadv``."""
RUN_BYTES = 3 << 19
"""Bytes of records lying end to end in a shard file (each up to ``ONE_READ_BYTES``) read by one ``preadv`` into
their several destinations, then hashed one by one (``read_many``): four 16-token records of the ``small`` preset.
A ``preadv`` has a fixed cost beside its copy (about 2 us, 0.005 CPU s/GB of 384 KiB records) and each record's
Python around it another few; on the AMD EPYC measured a 384 KiB record read and hashed alone cost 0.095 CPU s/GB,
four at a time 0.090 and sixteen 0.090 (the hash from L3 no dearer than from L2; a raw read of the same records
0.076 one by one, 0.071 sixteen at a time: docs/benchmarks/pool.md, nineteenth pass). Four, not the batch's
sixteen: the helper thread takes runs in turn with the caller, so a batch is cut into several."""
HELPED_RUN_BYTES = 3 << 18
"""``RUN_BYTES`` on the two-thread way: two 16-token records of the ``small`` preset, so a batch of sixteen is eight
runs for the two threads to take in turn, not four: with four, a thread late to take its second run leaves the
other waiting up to a whole run at the end. On the AMD EPYC with the measuring process given the CPU (its
autogroup at nice -15 beside other sessions at load 6.4-6.9, five rounds, three runs: the nearest to a quiet
machine to be had) a 16-token batch read 7.8-10.1 GB/s (median) in runs of four, 10.7-11.4 in runs of two, 9.2 in
runs of three and 9.5 a record at a time, against 9.2-9.3 on one thread and a raw read of 13.8-14.1
(docs/benchmarks/pool.md, twentieth pass). One thread alone keeps ``RUN_BYTES`` (runs of two cost it 2-3% more
CPU)."""
RUN_RECORDS = 64
"""At most this many records in one run (a ``preadv`` takes at most ``IOV_MAX``, 1024, buffers)."""
PAGE_BYTES = 4096
ALIASED_BYTES = 64
"""A kernel copy (``preadv`` from the page cache) whose destination lies 1 to ``ALIASED_BYTES - 1`` bytes past its
source modulo ``PAGE_BYTES`` is read through a bounce buffer (``read_with_checksum``). On the AMD EPYC (Zen 3)
measured, ``rep movsb`` (the kernel's copy to user memory with FSRM, and glibc's ``memcpy`` at these sizes) cost
4-8x its CPU at such a distance: 0.36-0.37 CPU s/GB for destinations 8-31 bytes past the page-aligned source,
0.61-0.67 at 1-7, 0.08-0.09 at 0 and 32-4095 (docs/benchmarks/pool.md, eighteenth pass). A shard's records start
page-aligned in its file, and numpy's large arrays (glibc ``mmap``-ed chunks) start 16 bytes into a page, so a
get into a staging buffer numpy allocated took this path: a 16-token get cost 0.48 CPU s/GB instead of 0.17. 32
bytes were measured; 64 (a cache line) leaves a margin for other cores."""
BOUNCE_SHIFT = PAGE_BYTES // 2
"""Where the bounce buffer lies against the source, modulo a page: far from both the source (the kernel's copy
into it) and the destination (the copy out of it, ``ALIASED_BYTES`` at most past the source)."""
MAX_OPEN_FILES = 32
"""Shard files kept open for reading at once (least recently read closed first)."""
UNAVAILABLE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EAGAIN})
"""Errors that say nothing about the record (the process is out of descriptors or memory, a call interrupted):
raised to the caller, a miss this time, never taken for a damaged record."""
ReadResult = Digest | OSError | None
"""A record read by ``read_many``: its digest; None when missing, unreadable or cut short; an ``UNAVAILABLE``
error, for the caller to raise where it would have been raised."""
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def read_result(err: OSError) -> OSError | None:
    """A failed read's ``ReadResult``: the error when it says nothing about the record (``UNAVAILABLE``: raised
    to the caller, a miss this time), else None (the record is missing or damaged)."""
    return err if err.errno in UNAVAILABLE else None


def _pread(fd: int, chunk: np.ndarray, offset: int, on_cold: Callable[[], None] | None) -> int:
    """``preadv`` of ``chunk`` at ``offset``; with ``on_cold``, first without waiting for the device, calling
    ``on_cold`` (once) when the page cache did not hold it all."""
    if on_cold is None or _NOWAIT is None:
        return os.preadv(fd, (chunk,), offset)
    try:
        got = os.preadv(fd, [chunk], offset, _NOWAIT)
    except OSError:  # EAGAIN: nothing cached at offset; EOPNOTSUPP: a filesystem without it
        got = 0
    if got == chunk.size:
        return got
    on_cold()
    return got + os.preadv(fd, [chunk[got:]], offset + got)


def aliased(destination: int, offset: int) -> bool:
    """Whether a kernel copy from file ``offset`` to memory at ``destination`` is at a slow distance
    (``ALIASED_BYTES``): page-cache pages are page-aligned, so the source lies at ``offset`` modulo a page."""
    return 0 < (destination - offset) % PAGE_BYTES < ALIASED_BYTES


_bounces = threading.local()  # per thread (read_many reads on two at once): (buffer, its address)


def _bounce(offset: int, n: int) -> tuple[np.ndarray, int]:
    """This thread's bounce buffer for ``n`` bytes (at most ``ONE_READ_BYTES``) read from file ``offset``, lying
    ``BOUNCE_SHIFT`` past it modulo a page, and its address (allocated once per thread, with a page of slack either
    side to slide it; its address kept, as numpy's lookup costs microseconds)."""
    spare = getattr(_bounces, "spare", None)
    if spare is None:
        buffer = np.empty(ONE_READ_BYTES + 2 * PAGE_BYTES, np.uint8)
        spare = _bounces.spare = (buffer, writable_address(buffer))
    buffer, at = spare
    shift = (offset + BOUNCE_SHIFT - at) % PAGE_BYTES
    return buffer[shift : shift + n], at + shift


def _digest(buf: np.ndarray, at: int, native: bool) -> Digest:
    """``buf``'s XXH3-128 digest as ``(high, low)``: ``native``, without the GIL (``xxh3_nogil.hash_at``, which the
    caller has checked is bound; ``at``: where ``buf`` starts), else by the package (which holds the GIL for 64
    KiB and under)."""
    if native:
        return xxh3_nogil.hash_at(at, buf.size)
    digest = xxh3_128_intdigest(buf)
    return digest >> 64, digest & LOW_WORD  # split_digest, written out: once per record of a get


def _read_bounced(fd: int, out: np.ndarray, at: int, offset: int, on_cold: Callable[[], None] | None,
                  native: bool = False) -> tuple[int, int] | None:
    """``read_with_checksum`` for an ``out`` (starting at address ``at``) at a slow distance from its source
    (``aliased``): read into the bounce buffer (a record up to ``ONE_READ_BYTES`` at once, a larger one in
    ``READ_STEP_BYTES`` steps), hashed there from cache and copied on into ``out`` with streaming stores
    (``stream_copy.py``; ``memcpy`` where that copy is missing, at a fast distance too): an extra copy from cache
    instead of a slow kernel copy. ``native``: a record read at once is hashed without the GIL
    (``read_with_checksum``)."""
    n = out.size
    copy = streaming_copy()
    if n <= ONE_READ_BYTES:
        bounce, bounce_at = _bounce(offset, n)
        if _pread(fd, bounce, offset, on_cold) != n:
            return None
        digest = _digest(bounce, bounce_at, native)
        if copy is None:
            out[:] = bounce
        else:
            copy(at, bounce_at, n)
        return digest
    bounce, bounce_at = _bounce(offset, READ_STEP_BYTES)
    hasher = xxh3_128()
    for start in range(0, n, READ_STEP_BYTES):
        step = bounce[: min(READ_STEP_BYTES, n - start)]
        if _pread(fd, step, offset + start, on_cold) != step.size:
            return None
        hasher.update(step)
        if copy is None:
            out[start : start + step.size] = step
        else:
            copy(at + start, bounce_at, step.size)
    return split_digest(hasher.intdigest())


def read_with_checksum(fd: int, out: np.ndarray, offset: int, on_cold: Callable[[], None] | None = None,
                       native: bool = False) -> tuple[int, int] | None:
    """Read ``out.size`` bytes of ``fd`` at ``offset`` into ``out`` (flat uint8) and return their XXH3-128 digest
    as ``(high, low)``; None when the file ends first (a shard file cut short). ``on_cold``: called when a part is
    not in the page cache, before it is read from the device. An ``out`` at a slow distance from the page cache
    (``aliased``) is read through a bounce buffer. ``native``: a record read at once (up to ``ONE_READ_BYTES``) is
    hashed without the GIL (``xxh3_nogil``, where it can be bound), so another thread can read or hash meanwhile:
    the two-thread way of ``read_many``. A larger record, read in ``READ_STEP_BYTES`` steps, is hashed by the
    package's ``xxh3_128().update`` either way, which releases the GIL itself for steps over 64 KiB
    (``xxh3_nogil``): its steps hashed through the ``ctypes`` binding's streaming calls instead cost more than they
    gave (a 128-token batch on two threads 0.185 against 0.163 CPU s/GB and 9.0-9.3 against 9.7-10.1 GB/s, two runs,
    twentieth pass: both ways without the GIL, the binding's dearer per call)."""
    n = out.size
    at = writable_address(out) if n else 0  # (ctypes takes no empty buffer)
    native = native and xxh3_nogil.hash_at is not None
    if aliased(at, offset):
        return _read_bounced(fd, out, at, offset, on_cold, native)
    if n <= ONE_READ_BYTES:  # one read, hashed from cache (a 16-token block)
        if _pread(fd, out, offset, on_cold) != n:
            return None
        return _digest(out, at, native)
    return fill_with_checksum(out, lambda step, start: _pread(fd, step, offset + start, on_cold) == step.size,
                              READ_STEP_BYTES)


def read_run(fd: int, outs: Sequence[np.ndarray], offset: int, on_cold: Callable[[], None] | None = None,
             addresses: Sequence[int] | None = None) -> list[ReadResult]:
    """Read records lying end to end in ``fd`` from ``offset`` into ``outs`` (flat uint8, each up to
    ``ONE_READ_BYTES``, none at a slow distance from its source: ``aliased``) with one ``preadv``, then hash each
    (``RUN_BYTES``); the result of each as ``read_many`` gives it. With ``on_cold``, the ``preadv`` does not wait for
    the device: when the page cache did not hold the whole run, ``on_cold`` is called and the records that did not
    land whole are read one by one (``read_with_checksum``, waiting), as are all of them when the run's ``preadv``
    fails (each then meets its own error) or the file ends inside it. ``addresses``: where each out starts; given,
    the records are hashed without the GIL (``xxh3_nogil``, where it can be bound: the two-thread way of
    ``read_many``)."""
    native = addresses is not None and xxh3_nogil.hash_at is not None
    nowait = on_cold is not None and _NOWAIT is not None
    try:
        got = os.preadv(fd, outs, offset, _NOWAIT if nowait else 0)
    except OSError:  # EAGAIN: nothing cached at offset; EOPNOTSUPP: no RWF_NOWAIT here; or a real error, which
        got = 0  # each record then meets in its own read below
    results: list[ReadResult] = []
    start = 0
    for j, out in enumerate(outs):
        end = start + out.size
        if end <= got:
            results.append(_digest(out, addresses[j] if native else 0, native))
        else:
            if on_cold is not None:
                on_cold()  # (once: it hands the wanted runs to the kernel and forgets them)
                on_cold = None
            try:
                results.append(read_with_checksum(fd, out, offset + start, native=native))
            except OSError as err:
                results.append(read_result(err))
        start = end
    return results


def _runs(reads: Sequence[tuple[int, int, np.ndarray]], addresses: Sequence[int] | None = None,
          most: int | None = None) -> list[tuple[int, int]]:
    """``read_many``'s reads cut into ``(first, count)`` runs: records lying end to end in one shard, in the order
    given, each up to ``ONE_READ_BYTES`` and none at a slow distance from its source (``aliased``, written out
    here: this loop is a share of a 16-token get's Python), up to ``most`` bytes (``RUN_BYTES`` unless told) and
    ``RUN_RECORDS`` a run; any other read is a run of its own. ``addresses``: where each ``out`` starts, when the
    caller knows (else looked up here, about 0.7 us each)."""
    most = RUN_BYTES if most is None else most
    runs: list[tuple[int, int]] = []
    end_shard, end_offset, run_bytes, count = -1, -1, 0, 0  # where the last run ends (-1: it takes no more)
    for i, (shard, offset, out) in enumerate(reads):
        n = out.size
        if 0 < n <= ONE_READ_BYTES and not 0 < ((writable_address(out) if addresses is None else addresses[i])
                                                 - offset) % PAGE_BYTES < ALIASED_BYTES:
            if shard == end_shard and offset == end_offset and run_bytes + n <= most and count < RUN_RECORDS:
                run_bytes += n
                count += 1
            else:
                if count:
                    runs.append((i - count, count))
                run_bytes, count = n, 1
            end_shard, end_offset = shard, offset + n
        else:
            if count:
                runs.append((i - count, count))
            runs.append((i, 1))
            end_shard, end_offset, run_bytes, count = -1, -1, 0, 0
    if count:
        runs.append((len(reads) - count, count))
    return runs


class Pace:
    """Which way of reading a batch has been faster lately: with the helper thread (True) or on the caller's thread
    alone (False), by the median seconds per byte of each way's last ``window`` batches; until each way has
    ``window // 2`` of them the ways take turns, and afterwards the slower way is tried every ``explore_every``
    batches, so a change of load (a core freed or taken) is seen within a few dozen batches; a batch is counted
    only where it could be shared, and then always recorded (``read_many``: its tries are not spent on batches it
    never hears of). One per process and
    record size (``pace_for``), shared by every store of that size: whether a core is free for the helper is the
    machine's state, not a store's, and a store opened for a few batches finds it learnt; but seconds per byte
    differ with the record size (a 3 MiB record is read by 1 MiB ``preadv``s, a 384 KiB one in one, with the
    pool's per-record work spread over 8x fewer bytes), so one size's batches must not decide for another's. With
    one ``Pace`` for all sizes, the benchmark's 16-token batches, read after 128-token ones, went the helper's way in
    30 of 32 batches of a trial on a machine where it was the slower way for them (tenth pass, docs/benchmarks/
    pool.md): the other way's window held 128-token figures, and was tried again only every 16th batch.

    A slower way more than ``far`` times slower is tried only every ``far_explore_every`` batches: the helper's way
    on a loaded machine (it cannot be more than twice as fast as the caller alone, so only it is ever that far
    behind). There, a 16-token batch read with the helper took 2-5x the caller's time (its run of four records
    waited on a thread not scheduled: 160-490 us/MB against 92-95, load 3.5, nineteenth pass), so its two tries in
    a 32-batch trial cost 15-25% of the trial's reads; a freed core is still noticed within a few hundred batches."""

    window = 8
    explore_every = 16
    far = 2.0
    far_explore_every = 64

    def __init__(self) -> None:
        self._seconds_per_byte: dict[bool, deque[float]] = {way: deque(maxlen=self.window) for way in (True, False)}
        self._batches = 0
        self._lock = threading.Lock()  # stores of several threads share it

    def helped(self) -> bool:
        """Whether the next batch should be read with the helper."""
        with self._lock:
            self._batches += 1
            with_helper, alone = self._seconds_per_byte[True], self._seconds_per_byte[False]
            if min(len(with_helper), len(alone)) < self.window // 2:
                return len(with_helper) <= len(alone)
            helper_s, alone_s = statistics.median(with_helper), statistics.median(alone)
            faster = helper_s <= alone_s
            every = self.far_explore_every if max(helper_s, alone_s) > self.far * min(helper_s, alone_s) \
                else self.explore_every
            return faster != (self._batches % every == 0)

    def took(self, helped: bool, seconds: float, nbytes: int, warm: bool = True) -> None:
        """A batch read ``helped`` or not took ``seconds`` for ``nbytes``; a batch not ``warm`` is dropped (its
        reader reads the next batch the same way, to be timed warm: ``ShardReader.read_many``). A cold try of the
        helper cost 101-456 us/MB against 72-90 in a streak, so a trial that began alone stayed alone (twenty-first
        pass, docs/benchmarks/pool.md).

        A try of the slower way that beats the faster way's median says the machine changed (a core freed, or
        taken): the tried way's older figures are forgotten, so it is taken in turn until it has half a window again,
        and then the medians decide. Without it a way that once read slow (a far-slower helper, tried every
        ``far_explore_every`` batches) needed half its window of tries to move its median: 320 batches, ten of the
        benchmark's 32-batch trials. Both quiet runs of the seventeenth session read their first 16-token trial with
        the helper (10.0-10.5 GB/s, 1.5 cores) and the other four alone (8.6-9.0 GB/s, one core): likely one slow
        spell, never forgotten."""
        with self._lock:
            if not warm:
                return
            rate = seconds / max(nbytes, 1)
            mine, other = self._seconds_per_byte[helped], self._seconds_per_byte[not helped]
            if min(len(mine), len(other)) >= self.window // 2:
                theirs = statistics.median(other)
                if rate < theirs < statistics.median(mine):
                    mine.clear()
            mine.append(rate)


PACE = Pace()
"""The process's ``Pace`` for a ``ShardReader`` not told its record size."""
_PACES: dict[int, Pace] = {}
_PACES_LOCK = threading.Lock()


def pace_for(record_bytes: int) -> Pace:
    """The process's ``Pace`` for batches of records of ``record_bytes`` bytes (one per size, made on first use)."""
    with _PACES_LOCK:
        pace = _PACES.get(record_bytes)
        if pace is None:
            pace = _PACES[record_bytes] = Pace()
        return pace


class _Slot:
    """What ``Helper`` and its thread share besides the two locks: the work handed over and what it raised."""

    __slots__ = ("work", "error")

    def __init__(self) -> None:
        self.work: Callable[[], None] | None = None
        self.error: BaseException | None = None


def _serve(go: threading.Lock, done: threading.Lock, slot: _Slot) -> None:
    """The helper thread: runs each work handed over in ``slot`` when ``go`` is released, releasing ``done`` after;
    ends when released with no work. It holds no reference to its ``Helper`` (nor, between batches, to a batch's
    work, whose closures hold the reader), so a reader dropped without ``close`` is collected and its finalizer
    ends the thread."""
    while True:
        go.acquire()
        work, slot.work = slot.work, None
        if work is None:  # closed
            done.release()
            return
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - handed to the caller by finish
            slot.error = err
        work = None  # (a batch's closures hold its reader: not kept while idle)
        done.release()


def _stop(go: threading.Lock, done: threading.Lock, slot: _Slot, thread: threading.Thread, pid: int) -> None:
    """End the helper thread (``Helper.close``, or its finalizer when a ``Helper`` is dropped unclosed). In a
    process other than ``pid``, the one that started the thread (a forked child), there is no thread to end and
    none would release ``done``: it returns at once rather than hang the child."""
    if os.getpid() != pid:
        return
    slot.work = None
    go.release()
    done.acquire()
    if thread is not threading.current_thread():  # (a finalizer may run on any thread, the helper's too)
        thread.join()


class Helper:
    """One thread that runs a batch's ``work`` beside the caller when told, handed it through two bare locks: a
    round trip (told, done, waited for) cost about 17 us of CPU against 41 us through a one-thread
    ``ThreadPoolExecutor`` (``submit`` and ``wait``: a future, a queue and a condition each time), measured on the
    AMD EPYC at load 3.5; per 16-token batch that is 0.004 CPU s/GB (twentieth pass). ``start`` hands it the work;
    ``finish`` either takes the work back (``go`` acquired without waiting: the thread has not woken, and never
    will for this batch, so a caller that did every run itself does not wait for a thread the machine has not
    scheduled) or waits until it is done, then raises what it raised.

    One caller at a time: ``start`` to ``finish`` holds ``_caller`` (a second ``start`` before ``finish`` raises
    ``RuntimeError``; the handshake has one slot). A ``ShardReader`` is used by one thread at a time (its store's
    owner serialises: ``BlockPool._lock``). The thread is given only the locks and the slot, never the ``Helper``,
    and a finalizer stops it: a ``Helper`` (or its reader) dropped without ``close`` does not leave a thread
    blocked for the process's life (the ``ThreadPoolExecutor`` it replaced did not either: its worker exits once
    the executor is collected)."""

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._caller = threading.Lock()  # held from start to finish
        self._slot = _Slot()
        self._thread = threading.Thread(target=_serve, args=(self._go, self._done, self._slot), name="ssd-read",
                                        daemon=True)
        self._thread.start()
        self._stop = weakref.finalize(self, _stop, self._go, self._done, self._slot, self._thread, os.getpid())

    def start(self, work: Callable[[], None]) -> None:
        if not self._caller.acquire(blocking=False):
            raise RuntimeError("Helper serves one caller at a time: start again before finish")
        self._slot.work = work
        self._go.release()

    def finish(self, raising: bool = True) -> None:
        """Once ``start``'s work is not running and never will: taken back, or waited for; then what it raised is
        raised (``raising``: not while the caller's own failure is on its way)."""
        slot = self._slot
        if self._go.acquire(blocking=False):
            slot.work = None  # never woken for it
            self._caller.release()
            return
        self._done.acquire()
        error, slot.error = slot.error, None
        self._caller.release()
        if error is not None and raising:
            raise error

    def close(self) -> None:
        """End the thread (once; later calls do nothing)."""
        with self._caller:  # (not in a batch)
            self._stop()


class ShardReader:
    """Descriptors of one store's shard files, opened for reading on first use (``path_of(shard)`` names them).
    Used by one thread at a time (its descriptor cache and ``Helper`` are unguarded; the store's owner serialises:
    ``BlockPool._lock``)."""

    def __init__(self, path_of: Callable[[int], Path], pace: Pace = PACE) -> None:
        self._path_of = path_of
        self._open: OrderedDict[int, int] = OrderedDict()  # shard -> descriptor, least recently read first
        self._wanted: list[tuple[int, int, int]] = []  # (shard, offset, length) runs a batch is about to read
        self._helper: Helper | None = None  # reads a batch's records beside the caller (read_many)
        self._pace = pace
        self._last_way: bool | None = None  # the way of this reader's last paced batch
        self._repeat: bool | None = None  # the way of a cold paced batch, taken once more to be timed warm
        self._advising = threading.Lock()  # both threads of a read_many may find the page cache cold at once

    def _fd(self, shard: int) -> int:
        fd = self._open.get(shard)
        if fd is not None:
            self._open.move_to_end(shard)
            return fd
        fd = os.open(self._path_of(shard), os.O_RDONLY | os.O_CLOEXEC)
        self._open[shard] = fd
        if len(self._open) > MAX_OPEN_FILES:
            os.close(self._open.popitem(last=False)[1])
        return fd

    def read(self, shard: int, offset: int, out: np.ndarray) -> tuple[int, int] | None:
        """Read a chunk of ``shard`` at ``offset`` into ``out`` (flat uint8); its digest, or None when the file is
        missing, unreadable or too short (a damaged record). An ``UNAVAILABLE`` error is raised."""
        try:
            return read_with_checksum(self._fd(shard), out, offset, self._advise_wanted if self._wanted else None)
        except OSError as err:
            if err.errno in UNAVAILABLE:
                raise
            return None

    def read_many(self, reads: Sequence[tuple[int, int, np.ndarray]],
                  addresses: Sequence[int] | None = None) -> list[ReadResult]:
        """Read and hash each ``(shard, offset, out)`` chunk, on this thread and, when ``Pace`` finds it faster, a
        helper thread, each taking the next run (module docstring); the result of each, in order. Records lying
        end to end in a shard, in the order given, are read a run at a time (``read_run``, ``RUN_BYTES``, or
        ``HELPED_RUN_BYTES`` on two threads). Every read has ended when this returns, so nothing writes into an
        ``out`` after it. One caller at a time (``Helper``).

        ``addresses``: where each ``out`` starts, when the caller knows (a batch's staging rows: one lookup for
        all), one per read: ``addresses[i]`` must be the address of ``reads[i]``'s ``out``'s first byte. On the
        two-thread way they reach C as pointers (``xxh3_nogil.hash_at`` reads ``out.size`` bytes there), so a wrong
        one would hash other memory, or fault: their count is checked, and each run's first address against its
        ``out`` (``ValueError``; a lookup per run, about 0.5 us).

        Only a batch of several records over ``HELPED_RUN_BYTES`` in all is sure to be more than one run on the
        two-thread way, so only such a batch asks ``Pace`` which way to go, and it records the time it took under
        the way it went (told whether it was warm, a cold batch's way taken once more unasked: ``_took``), cut at
        that way's run size: every answer ``Pace`` gives is followed by a figure, so its tries of the slower way are
        not spent on batches that record nothing (a 2-record 16-token batch, 768 KiB, is one run either way), and a
        batch that is one run alone (3-4 such records) is recorded whichever way it went. The total decides, not a
        first cut at ``HELPED_RUN_BYTES`` (a second cut, about 4 us, cost the one-thread way of a 16-token batch
        about 1% of its CPU): a batch of several runs under it (records apart in the file) is read alone unasked, as
        too small to share. A batch spanning more shard files than stay open is read on this thread alone and
        recorded under neither way (the descriptors of the two-thread way are all opened first, here, so the helper
        never touches the descriptor cache, and opening more than stay open might close one in use); it does not ask
        ``Pace``."""
        results: list[ReadResult] = [None] * len(reads)
        if addresses is not None and len(addresses) != len(reads):
            raise ValueError(f"{len(addresses)} addresses for {len(reads)} reads")
        nbytes = sum(out.size for _, _, out in reads) if len(reads) > 1 else 0
        paced = nbytes > HELPED_RUN_BYTES and (len(reads) <= MAX_OPEN_FILES or
                                               len({shard for shard, _, _ in reads}) <= MAX_OPEN_FILES)
        if paced and self._repeat is not None:  # a cold batch's way once more (not asked: Pace counts its asks)
            helped, self._repeat = self._repeat, None
        else:
            helped = paced and self._pace.helped()
        runs = _runs(reads, addresses, HELPED_RUN_BYTES if helped else RUN_BYTES)
        on_cold = self._advise_wanted if self._wanted else None
        native = helped and xxh3_nogil.hash_at is not None  # hashes without the GIL: both threads hash at once

        def read(first: int, count: int, fd: int) -> None:
            shard, offset, out = reads[first]
            if count == 1:
                try:
                    results[first] = read_with_checksum(fd, out, offset, on_cold, native)
                except OSError as err:
                    results[first] = read_result(err)
            else:
                outs = [item[2] for item in reads[first : first + count]]
                if not native:
                    at = None
                elif addresses is None:
                    at = [writable_address(out) for out in outs]
                else:
                    at = addresses[first : first + count]
                    if at[0] != writable_address(out):
                        raise ValueError(f"address {at[0]:#x} given for a read whose out starts elsewhere")
                results[first : first + count] = read_run(fd, outs, offset, on_cold, at)

        if not helped:
            started = time.perf_counter()
            last_shard, fd = -1, -1
            for first, count in runs:
                shard = reads[first][0]
                if shard != last_shard:  # a batch's records mostly lie in one shard: its descriptor looked up once
                    try:
                        fd, last_shard = self._fd(shard), shard  # (neither set when the open fails)
                    except OSError as err:
                        results[first : first + count] = [read_result(err)] * count
                        continue
                read(first, count, fd)
            if paced:
                self._took(False, time.perf_counter() - started, nbytes)
            return results
        shards = {shard for shard, _, _ in reads}
        started = time.perf_counter()
        fds: dict[int, int | OSError] = {}
        for shard in shards:
            try:
                fds[shard] = self._fd(shard)
            except OSError as err:
                fds[shard] = err
        taken = iter(runs)
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    run = next(taken, None)
                if run is None:
                    return
                first, count = run
                fd = fds[reads[first][0]]
                if isinstance(fd, OSError):
                    results[first : first + count] = [read_result(fd)] * count
                else:
                    read(first, count, fd)

        if self._helper is None:
            self._helper = Helper()
        self._helper.start(work)
        try:
            work()
        except BaseException:
            self._helper.finish(raising=False)  # even when this thread failed: nothing may write into an out once
            raise  # this returns
        self._helper.finish()  # the helper's own failure (a read's OSError is its result, not this)
        self._took(True, time.perf_counter() - started, nbytes)
        return results

    def _took(self, helped: bool, seconds: float, nbytes: int) -> None:
        """Tell ``Pace`` of a paced batch, and whether it was warm: not this reader's first paced batch, nor a batch
        with the helper after one without (its thread idle since its last try, or just made). Warm is judged by the
        order of this reader's batches, not by how long the thread was idle: a batch with the helper after a long
        pause (the next request's get) counts as warm. A cold batch is dropped and the next paced batch goes the same
        way, unasked; the repeat is the reader's, not ``Pace``'s, so one reader's cold batch does not decide the way
        of another reader of the same record size."""
        warm = self._last_way is True if helped else self._last_way is not None
        self._pace.took(helped, seconds, nbytes, warm)
        if not warm:
            self._repeat = helped
        self._last_way = helped

    def read_exact(self, shard: int, offset: int, out: np.ndarray) -> bool:
        """Read a chunk of ``shard`` at ``offset`` into ``out`` unhashed (the caller verifies it); False when the
        file is missing, unreadable or too short."""
        try:
            return os.preadv(self._fd(shard), [out], offset) == out.size
        except OSError as err:
            if err.errno in UNAVAILABLE:
                raise
            return False

    def want(self, runs: list[tuple[int, int, int]]) -> None:
        """The ``(shard, offset, length)`` runs a batch is about to read, replacing those of the batch before:
        asked for from the kernel if a read finds the page cache cold."""
        self._wanted = runs

    def _advise_wanted(self) -> None:
        """Tell the kernel the wanted runs are needed soon (``POSIX_FADV_WILLNEED``): what is not in the page cache
        is read from the device in the background while the records before it are copied and hashed."""
        with self._advising:
            runs, self._wanted = self._wanted, []
        for shard, offset, length in runs if _WILLNEED is not None else ():
            try:
                self._advise(shard, offset, length)
            except OSError:
                pass  # only advice: the read will say what is wrong

    def _advise(self, shard: int, offset: int, length: int) -> None:
        """Advise on an open descriptor, or on one opened for it alone: never through ``_fd``, whose cache would
        close the least recently read descriptor, possibly the one the read asking for advice is using (the advice
        is on the file's page cache, so it outlives the descriptor it was given on)."""
        fd = self._open.get(shard)
        if fd is not None:
            os.posix_fadvise(fd, offset, length, _WILLNEED)
            return
        fd = os.open(self._path_of(shard), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, offset, length, _WILLNEED)
        finally:
            os.close(fd)

    def forget(self, shard: int) -> None:
        """Close ``shard``'s descriptor (it is being deleted)."""
        fd = self._open.pop(shard, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        if self._helper is not None:
            self._helper.close()
            self._helper = None
        while self._open:
            os.close(self._open.popitem()[1])
