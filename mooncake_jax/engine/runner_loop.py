"""The model-runner loop: the one thread that dispatches an engine's JAX work, driven by its ``Scheduler``.

Every engine call (prefill, admitting a request whose KV a transfer thread staged, each decode step, reading blocks
out for the pool) runs on this thread, in order: on multi-host JAX, hosts that enqueue device work in different
orders from several threads deadlock, and on one host it keeps the engine's bookkeeping single-threaded without
locks. No storage or network I/O runs here: transfer threads (``TransferWorkers``) stage KV in host buffers first.

Other threads (gRPC handlers, transfer threads) queue work with the scheduler (``submit`` / ``add_request``, a
bounded queue) and get a Future back; each iteration runs ``Scheduler.step()``: start what fits, one decode step
for every running sequence, tokens to each sequence's ``TokenStream``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..model.engine import Engine
from ..model.sequence import Sequence
from .scheduler import DEFAULT_MAX_WAITING, Scheduler


class LoopStopped(RuntimeError):
    """The engine loop is shutting down; the work was not done."""


class TokenStream:
    """Tokens of one running sequence, from the loop thread to the thread serving the request.

    Iterating yields token ids and ends when the sequence finishes (``finish_reason`` is then set); an error on the
    loop side is raised in the reader. ``timeout_s`` bounds the wait for each token, so a reader never hangs.

    With a ``feed`` (a ``gateway/token_feed.FeedSender``) each token is sent there by the putting thread, and the
    reader takes them in batches instead (``batches``): a token then wakes no thread but the gateway's, which is
    what the feed is for (``token_feed.py``).
    """

    _DONE = object()

    def __init__(self, timeout_s: float = 60.0, feed=None):
        self._queue: queue.Queue = queue.Queue()
        self.finish_reason: str | None = None
        self.timeout_s = timeout_s
        self._feed = feed
        self._fed: list[int] = []  # with a feed: every token put, read by ``batches``
        self._ended = threading.Event()  # with a feed: finished or failed

    @property
    def feeds(self) -> bool:
        return self._feed is not None

    def put(self, token: int) -> None:
        if self._feed is None:
            self._queue.put(token)
            return
        self._fed.append(token)
        self._feed.send(len(self._fed), token)  # the request's first token came from its prefill: index = count

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._queue.put(self._DONE)
        self._ended.set()

    def fail(self, error: BaseException) -> None:
        self._queue.put(error)
        self._ended.set()

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

    def batches(self, interval_s: float):
        """With a feed: ``(index of the first, tokens)`` for the tokens put since the last batch, at most one batch
        each ``interval_s`` (none while nothing was put), the last as the sequence ends; ends like iterating."""
        sent, progress = 0, time.monotonic()
        while True:
            ended = self._ended.wait(interval_s)
            count = len(self._fed)  # after the wait: once ended, every put is in
            if count > sent:
                yield sent + 1, self._fed[sent:count]
                sent, progress = count, time.monotonic()
            if ended:
                item = self._queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                return
            if time.monotonic() - progress > self.timeout_s:
                raise TimeoutError(f"no token for {self.timeout_s} s")


class RunnerLoop:
    """Runs ``scheduler.step()`` on one thread while there is work; sleeps on the scheduler's condition otherwise."""

    def __init__(self, engine: Engine, name: str = "engine-loop", max_waiting: int = DEFAULT_MAX_WAITING,
                 join_budget_steps: float | None = None):
        self.engine = engine
        self.scheduler = Scheduler(engine, max_waiting=max_waiting, join_budget_steps=join_budget_steps)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # ---- called from any thread -------------------------------------------------------------------------
    def start(self) -> "RunnerLoop":
        self._thread.start()
        return self

    def submit(self, job: Callable[[Engine], object], *, joins_batch: bool = False,
               wait_for_room: bool = True) -> Future:
        """Run ``job(engine)`` on the loop thread (see ``Scheduler.submit``); QueueFull when the queue is full."""
        if self._stopping:
            future: Future = Future()
            future.set_exception(LoopStopped("the engine is shutting down"))
            return future
        return self.scheduler.submit(job, joins_batch=joins_batch, wait_for_room=wait_for_room)

    def add_request(self, seq: Sequence, stream: "TokenStream", wait_for_room: bool = True) -> Future:
        """Prefill ``seq`` when it fits and decode it in the running batch (see ``Scheduler.add_request``)."""
        if self._stopping:
            future: Future = Future()
            future.set_exception(LoopStopped("the engine is shutting down"))
            return future
        return self.scheduler.add_request(seq, stream, wait_for_room)

    def cancel(self, seq: Sequence) -> None:
        """Stop a running sequence (its client went away): it is released before the next step."""
        self.scheduler.cancel(seq)

    @property
    def queued_jobs(self) -> int:
        return self.scheduler.num_waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def steps(self) -> int:
        return self.scheduler.steps

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the current step, fail queued work and running streams with LoopStopped, and end the thread."""
        with self.scheduler.cond:
            self._stopping = True
            self.scheduler.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self.scheduler.close(LoopStopped("the engine is shutting down"))

    # ---- called from jobs, on the loop thread ---------------------------------------------------------------
    def join_batch(self, seq: Sequence, stream: "TokenStream") -> None:
        """Put a prefilled (or adopted) sequence into the running batch (BatchFull if it has no slot)."""
        self.scheduler.join(seq, stream)

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            with sched.cond:
                while not (sched.has_work or self._stopping):
                    sched.cond.wait()
                if self._stopping:
                    break
            sched.step()  # queued work waits only while sequences run, so this never spins idle
        sched.close(LoopStopped("the engine is shutting down"))


def wait(future: Future, timeout_s: float):
    """A job's result, raising its exception; TimeoutError if the loop did not get to it in time."""
    t = time.monotonic()
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the engine did not finish the job within {timeout_s:.1f} s "
                           f"(waited {time.monotonic() - t:.1f} s)") from None
