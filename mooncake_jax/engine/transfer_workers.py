"""Transfer threads: a small bounded worker pool per instance for KV I/O, off the compute thread.

Pool reads (DRAM and SSD), Messenger fetches and pushes, and pool writes run here. A worker stages a request's KV
in host buffers and the instance then hands the scheduler a ready insert (a job that only loads staged blocks into
pages), so a running decode batch never waits for someone else's transfer. The queue is bounded: one more task
than ``max_queued`` waiting raises ``QueueFull`` (RESOURCE_EXHAUSTED upstream) instead of piling up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .scheduler import QueueFull


class TransferWorkers:
    """``workers`` threads running I/O tasks; at most ``max_queued`` tasks queued or running at once."""

    def __init__(self, workers: int = 4, max_queued: int = 64, name: str = "transfer"):
        if workers < 1 or max_queued < workers:
            raise ValueError(f"need workers >= 1 and max_queued >= workers, got {workers} and {max_queued}")
        self.max_queued = max_queued
        self._slots = threading.BoundedSemaphore(max_queued)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on a transfer thread; QueueFull when ``max_queued`` tasks are pending."""
        if not self._slots.acquire(blocking=False):
            raise QueueFull(f"the transfer queue is full ({self.max_queued} transfers pending); retry later")
        try:
            future = self._executor.submit(fn, *args, **kwargs)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
