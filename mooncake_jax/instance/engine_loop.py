"""The one thread that dispatches an instance's JAX work.

Every engine call (prefill, admitting a request whose KV arrived, each decode step, reading blocks out for the pool)
runs on this thread, in order: on multi-host JAX, hosts that enqueue device work in different orders from several
threads deadlock, and on one host it keeps the engine's bookkeeping single-threaded without locks.

Other threads (gRPC handlers) hand it *jobs*, callables run between decode steps in FIFO order, and get a Future
back. A job may put a sequence into the running batch with ``join_batch``; from then on each loop iteration decodes
one token for every running sequence and delivers it to that sequence's ``TokenStream``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from ..model.engine import Engine
from ..model.sequence import FINISH_ABORT, Sequence

log = logging.getLogger(__name__)


class LoopStopped(RuntimeError):
    """The engine loop is shutting down; the work was not done."""


class TokenStream:
    """Tokens of one running sequence, from the loop thread to the thread serving the request.

    Iterating yields token ids and ends when the sequence finishes (``finish_reason`` is then set); an error on the
    loop side is raised in the reader. ``timeout_s`` bounds the wait for each token, so a reader never hangs.
    """

    _DONE = object()

    def __init__(self, timeout_s: float = 60.0):
        self._queue: queue.Queue = queue.Queue()
        self.finish_reason: str | None = None
        self.timeout_s = timeout_s

    def put(self, token: int) -> None:
        self._queue.put(token)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._queue.put(self._DONE)

    def fail(self, error: BaseException) -> None:
        self._queue.put(error)

    def __iter__(self):
        while True:
            try:
                item = self._queue.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no token for {self.timeout_s} s") from None
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class EngineLoop:
    """Runs jobs and continuous-batching decode steps for one engine on one thread."""

    def __init__(self, engine: Engine, name: str = "engine-loop"):
        self.engine = engine
        self._jobs: deque[tuple[Callable[[Engine], object], Future]] = deque()
        self._running: dict[int, tuple[Sequence, TokenStream]] = {}
        self._cancelled: set[int] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.steps = 0

    # ---- called from any thread -------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, job: Callable[[Engine], object]) -> Future:
        """Run ``job(engine)`` on the loop thread; its result or exception lands in the returned Future."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                future.set_exception(LoopStopped("the engine is shutting down"))
                return future
            self._jobs.append((job, future))
            self._cond.notify()
        return future

    def cancel(self, seq: Sequence) -> None:
        """Stop a running sequence (its client went away): it is released before the next step."""
        with self._cond:
            self._cancelled.add(seq.seq_id)
            self._cond.notify()

    @property
    def queued_jobs(self) -> int:
        return len(self._jobs)

    @property
    def running(self) -> list[Sequence]:
        return [seq for seq, _ in list(self._running.values())]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the current step, fail queued jobs and running streams with LoopStopped, and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- called from jobs, on the loop thread ---------------------------------------------------------------
    def join_batch(self, seq: Sequence, stream: TokenStream) -> None:
        """Put a prefilled (or adopted) sequence into the running batch; its tokens go to ``stream``."""
        if seq.finished:
            self.engine.release(seq)
            stream.finish(seq.finish_reason)
            return
        self._running[seq.seq_id] = (seq, stream)

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._jobs or self._running or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    break
                jobs = list(self._jobs)
                self._jobs.clear()
                cancelled, self._cancelled = self._cancelled, set()
            for job, future in jobs:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(job(self.engine))
                    except BaseException as e:  # delivered to the caller, never kills the loop
                        future.set_exception(e)
            for seq_id in cancelled:
                self._retire(seq_id, FINISH_ABORT)
            if self._running:
                self._decode()
        self._shutdown()

    def _decode(self) -> None:
        seqs = [seq for seq, _ in self._running.values()][: self.engine.max_batch]
        try:
            tokens = self.engine.decode(seqs)
        except Exception as e:  # a bug or a device failure: fail these requests, keep serving others
            log.exception("decode step failed")
            for seq in seqs:
                self._running[seq.seq_id][1].fail(e)
                self._retire(seq.seq_id, None)
            return
        self.steps += 1
        for seq, token in zip(seqs, tokens):
            stream = self._running[seq.seq_id][1]
            stream.put(token)
            if seq.finished:
                self._retire(seq.seq_id, seq.finish_reason)

    def _retire(self, seq_id: int, reason: str | None) -> None:
        entry = self._running.pop(seq_id, None)
        if entry is None:
            return
        seq, stream = entry
        self.engine.release(seq)
        if reason is not None:
            seq.finish_reason = seq.finish_reason or reason
            stream.finish(reason)

    def _shutdown(self) -> None:
        stopped = LoopStopped("the engine is shutting down")
        with self._cond:
            jobs = list(self._jobs)
            self._jobs.clear()
        for _, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(stopped)
        for seq_id in list(self._running):
            self._running[seq_id][1].fail(stopped)
            self._retire(seq_id, None)


def wait(future: Future, timeout_s: float):
    """A job's result, raising its exception; TimeoutError if the loop did not get to it in time."""
    t = time.monotonic()
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the engine did not finish the job within {timeout_s:.1f} s "
                           f"(waited {time.monotonic() - t:.1f} s)") from None
