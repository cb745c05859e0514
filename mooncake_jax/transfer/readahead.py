"""Working ahead of the consumer on a thread, so several blocks are in flight.

gRPC's synchronous API moves one streamed message at a time: a sender's generator is asked for the next message
only once the last one is handed to the transport, and a receiver's next message is only asked of the transport
(and turned into a ``bytes``) once the consumer comes back for it. Reading a record from the pool (copy and
verify) between two sends, or storing one (copy and verify) between two receives, leaves the link idle meanwhile.
An ``Ahead`` iterates a source on a thread of its own, at most ``depth`` items ahead of the consumer: the work on
item i overlaps the production of item i+1 (the copies, hashes and gRPC waits all release the GIL), and memory
stays bounded. A Messenger sender iterates its messages ahead (``outgoing.Outgoing``, records read and joined
several to a message); a receiver wraps the gRPC stream itself (``Ahead(call, join=False)``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_DONE = object()


class Ahead(Generic[T]):
    """Iterates the items of ``source`` in order, produced ahead on a thread; an exception from ``source`` is
    raised where its item would have come. ``close`` (or leaving ``with``) stops the thread once the item it is
    producing arrives, and waits for that if ``join`` (a source that may block on a peer, such as a gRPC stream,
    is not waited for: a handler must not hang on a peer that stops sending; its thread ends when the call does)."""

    def __init__(self, source: Iterable[T], depth: int = 4, name: str = "ahead", join: bool = True) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._join = join
        self._source = source
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _offer(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._offer((item, None)):
                    return
        except BaseException as err:  # handed to the consumer, which raises it
            self._offer((None, err))
            return
        self._offer(_DONE)

    def __iter__(self) -> Iterator[T]:
        while True:
            got = self._queue.get()
            if got is _DONE:
                return
            item, err = got
            if err is not None:
                raise err
            yield item

    def close(self) -> None:
        self._stop.set()
        if self._join:
            self._thread.join()

    def __enter__(self) -> Ahead[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
