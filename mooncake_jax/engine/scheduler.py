"""The scheduler: the one place that decides what an engine works on next (vLLM v1's Scheduler, JetStream's queues).

Every user of an engine goes through it: ``mj.LLM.generate`` (driving ``step()`` on its own thread), the coupled
backend, and the prefill and decode instances (whose ``RunnerLoop`` thread drives ``step()``). It owns

- the **waiting queue**: work submitted from any thread, bounded (``max_waiting``); one more raises ``QueueFull``,
  which instances map to RESOURCE_EXHAUSTED and the gateway to HTTP 429;
- the **running set**: sequences in the continuous batch, never more than the engine's ``max_batch``
  (``join`` refuses with ``BatchFull``; nothing is silently cut from a batch);
- **admission**: a request is admitted when the batch has a slot and the KV-cache manager can give it pages for
  its prompt plus a reservation for its whole generation (so a running sequence never runs out of pages). When
  pages run out a request waits at the head of the queue while running sequences will free pages, and is
  refused (``OutOfPages``, nothing held) when nothing runs that could; work that must not wait (a decode
  instance's late admission) is refused at once instead.

One ``step()``: start the queued work that fits (FIFO, in order; prefill-and-join requests are prefilled here;
with ``join_budget_steps``, while sequences run, only as much as that many mean decode steps' time, at least one
item, so that a burst of joins, each loading its KV into pages on this thread, stalls the running sequences one
join at a time rather than all at once), drop cancelled sequences, run one decode step for the whole running
batch, retire the finished ones. Queued work
is either a request (prompt -> prefill -> running batch) or a job: a callable on the compute thread, for work that
staged its I/O elsewhere first (a decode instance's adoption of a request whose KV a transfer thread read, a
prefill instance's prefill over a staged prefix) and for warm-up or calibration.

Threads: ``submit``/``add_request``/``cancel`` may be called from any thread; everything else, ``step`` included,
from the one compute thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from ..model.engine import Engine
from ..model.kv_cache import OutOfPages
from ..model.sequence import FINISH_ABORT, Sequence

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 64


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: retry later (RESOURCE_EXHAUSTED upstream, HTTP 429 at the gateway)."""


class BatchFull(RuntimeError):
    """The running batch has ``max_batch`` sequences and the work asked not to wait for a slot."""


class TokenSink(Protocol):
    """Where a running sequence's tokens go (``TokenStream`` for served requests)."""

    def put(self, token: int) -> None: ...

    def finish(self, reason: str) -> None: ...

    def fail(self, error: BaseException) -> None: ...


@dataclasses.dataclass(eq=False)
class _Work:
    run: Callable[[Engine], object]
    future: Future
    joins_batch: bool  # takes a slot of the running batch: started only when one is free
    wait_for_room: bool  # False: refused at once (BatchFull / OutOfPages) instead of waiting
    seq: Sequence | None = None  # a request: admitted by the scheduler before ``run`` prefills it


class Scheduler:
    """Admission, the waiting queue and the running batch of one engine."""

    def __init__(self, engine: Engine, max_waiting: int = DEFAULT_MAX_WAITING,
                 join_budget_steps: float | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if join_budget_steps is not None and not join_budget_steps >= 0:
            raise ValueError(f"join_budget_steps must be >= 0 or None, got {join_budget_steps!r}")
        self.join_budget_steps = join_budget_steps  # None: all queued work that fits starts before each step
        self.engine = engine
        self.kv = engine.kv
        self.max_batch = engine.max_batch
        self.max_waiting = max_waiting
        self.cond = threading.Condition()  # guards the waiting queue and the cancelled set; wakes the runner
        self._waiting: deque[_Work] = deque()
        self._cancelled: set[int] = set()
        self._running: dict[int, tuple[Sequence, TokenSink | None]] = {}
        self.steps = 0  # decode steps run
        self.step_seconds = 0.0  # time spent in them (the decode step time an operator compares TBT with)
        self.step_rows = 0  # sequences decoded in them (mean batch = step_rows / steps)
        self.closed = False

    # ---- any thread --------------------------------------------------------------------------------------------
    def submit(self, run: Callable[[Engine], object], *, joins_batch: bool = False,
               wait_for_room: bool = True) -> Future:
        """Queue ``run(engine)`` for the compute thread; its result or exception lands in the returned Future.

        ``joins_batch``: the job puts one sequence into the running batch (``join``), so it starts only when a slot
        is free; with ``wait_for_room=False`` it is refused with BatchFull instead of waiting, and an OutOfPages
        it raises is final. Raises QueueFull when ``max_waiting`` items already wait.
        """
        return self._queue(_Work(run, Future(), joins_batch, wait_for_room))

    def _queue(self, work: _Work) -> Future:
        with self.cond:
            if self.closed:
                raise RuntimeError("the scheduler is closed")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"the engine's queue is full ({self.max_waiting} requests waiting); retry later")
            self._waiting.append(work)
            self.cond.notify_all()
        return work.future

    def add_request(self, seq: Sequence, sink: TokenSink | None = None, wait_for_room: bool = True) -> Future:
        """Queue a validated new sequence: admitted (prefix reuse, pages, reservation) and prefilled when a batch
        slot and its pages are free, then decoded in the running batch. The Future resolves once its first token
        is sampled (to ``seq``), or to OutOfPages when it is refused."""
        return self._queue(_Work(lambda engine: self._prefill_and_join(seq, sink), Future(), True, wait_for_room,
                                 seq))

    def cancel(self, seq: Sequence) -> None:
        """Stop a running sequence (its client went away): it is released before the next decode step."""
        with self.cond:
            self._cancelled.add(seq.seq_id)
            self.cond.notify_all()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_room(self) -> bool:
        """Whether one more ``submit`` would be queued (a snapshot: other threads may fill the room first)."""
        return len(self._waiting) < self.max_waiting

    @property
    def running(self) -> list[Sequence]:
        return [seq for seq, _ in list(self._running.values())]

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._cancelled)

    # ---- the compute thread ---------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self._running)

    def join(self, seq: Sequence, sink: TokenSink | None = None) -> None:
        """Put an admitted, prefilled (or adopted) sequence into the running batch; its tokens go to ``sink``."""
        if seq.finished:  # nothing to decode (one token asked for, or the first was a stop token)
            self.kv.release(seq)
            if sink is not None:
                sink.finish(seq.finish_reason)
            return
        if len(self._running) >= self.max_batch:
            raise BatchFull(f"the decode batch is full ({self.max_batch} sequences)")
        self._running[seq.seq_id] = (seq, sink)

    def _prefill_and_join(self, seq: Sequence, sink: TokenSink | None) -> Sequence:
        try:  # admitted by ``_start_queued`` already
            self.engine.prefill(seq)
            self.join(seq, sink)
        except BaseException:
            self.kv.release(seq)
            raise
        return seq

    def _start_queued(self) -> None:
        """Start queued work in FIFO order while it fits. A joining item that must wait (no batch slot, or a request
        whose pages will only come back when running sequences finish) keeps its place and blocks the joining
        items behind it that may wait (no overtaking); jobs that take no slot pass it, and so does work that must
        not wait (it starts now if it fits, else it is refused)."""
        with self.cond:
            queue, self._waiting = self._waiting, deque()
        kept: deque[_Work] = deque()
        blocked = False
        deadline = self._queued_work_deadline()
        started = 0
        while queue:
            if started and time.perf_counter() >= deadline:  # the rest waits for the next step, in order
                kept.extend(queue)
                break
            work = queue.popleft()
            if work.future.cancelled():
                continue
            if work.joins_batch:
                if blocked and work.wait_for_room:
                    kept.append(work)
                    continue
                if self.free_slots <= 0:
                    if work.wait_for_room:
                        blocked = True
                        kept.append(work)
                    elif work.future.set_running_or_notify_cancel():
                        work.future.set_exception(BatchFull(f"the decode batch is full ({self.max_batch} sequences)"))
                    continue
            if work.seq is not None:
                try:
                    self.engine.admit(work.seq)
                except OutOfPages as e:
                    if work.wait_for_room and self._running:
                        blocked = True
                        kept.append(work)
                    elif work.future.set_running_or_notify_cancel():
                        work.future.set_exception(e)  # nothing runs that could free pages: refuse
                    continue
            if work.future.set_running_or_notify_cancel():
                started += 1
                try:
                    work.future.set_result(work.run(self.engine))
                except BaseException as e:  # delivered to the caller, never kills the compute thread
                    work.future.set_exception(e)
            elif work.seq is not None:
                self.kv.release(work.seq)
        with self.cond:
            self._waiting.extendleft(reversed(kept))

    def _queued_work_deadline(self) -> float:
        """When queued work stops starting before this step (``join_budget_steps`` mean steps from now while
        sequences run; no limit otherwise)."""
        if self.join_budget_steps is None or not self._running:
            return float("inf")
        mean_step = self.step_seconds / self.steps if self.steps else 0.0
        return time.perf_counter() + self.join_budget_steps * mean_step

    def step(self) -> list[Sequence]:
        """Start what fits, decode the running batch once, retire finished sequences (returned)."""
        self._start_queued()
        with self.cond:
            cancelled, self._cancelled = self._cancelled, set()
        finished = []
        for seq_id in cancelled:
            seq = self._retire(seq_id, FINISH_ABORT)
            if seq is not None:
                finished.append(seq)
        if self._running:
            finished += self._decode()
        return finished

    def _decode(self) -> list[Sequence]:
        entries = list(self._running.values())
        seqs = [seq for seq, _ in entries]
        t0 = time.perf_counter()
        try:
            tokens = self.engine.decode(seqs)
        except Exception as e:  # a bug or a device failure: fail these requests, keep serving others
            log.exception("decode step failed")
            for seq, sink in entries:
                if sink is not None:
                    sink.fail(e)
                self._retire(seq.seq_id, None)
            return []
        self.steps += 1
        self.step_seconds += time.perf_counter() - t0
        self.step_rows += len(seqs)
        finished = []
        for (seq, sink), token in zip(entries, tokens):
            if sink is not None:
                sink.put(token)
            if seq.finished:
                finished.append(self._retire(seq.seq_id, seq.finish_reason))
        return finished

    def _retire(self, seq_id: int, reason: str | None) -> Sequence | None:
        entry = self._running.pop(seq_id, None)
        if entry is None:
            return None
        seq, sink = entry
        self.kv.release(seq)
        if reason is not None:
            seq.finish_reason = seq.finish_reason or reason
            if sink is not None:
                sink.finish(reason)
        return seq

    def abort_all(self, error: BaseException) -> None:
        """Fail every queued item and running sequence with ``error``, releasing their pages (compute thread)."""
        with self.cond:
            works = list(self._waiting)
            self._waiting.clear()
            self._cancelled.clear()
        for work in works:
            if work.future.set_running_or_notify_cancel():
                work.future.set_exception(error)
        for seq_id in list(self._running):
            sink = self._running[seq_id][1]
            if sink is not None:
                sink.fail(error)
            self._retire(seq_id, None)

    def close(self, error: BaseException) -> None:
        """Refuse new work and fail what is queued or running with ``error`` (compute thread, at shutdown)."""
        with self.cond:
            self.closed = True
        self.abort_all(error)
