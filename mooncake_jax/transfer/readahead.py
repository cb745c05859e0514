"""Reading blocks ahead of the transport, so several are in flight.

gRPC's synchronous API sends one streamed message at a time and returns to the generator only once the message is
handed to the transport; reading (copying and verifying) the next record from the pool only then leaves the link
idle meanwhile. A ``ReadAhead`` runs the reads on a thread of its own, at most ``depth`` records ahead of the
sender: the copy and hash of block i+1 overlap the transport's work on block i (both release the GIL in their
long parts), and memory stays bounded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from mooncake_jax.blocks import BlockKey

T = TypeVar("T")
_DONE = object()


class ReadAhead(Generic[T]):
    """Iterates ``(key, read(key))`` for ``keys`` in order, the reads done ahead on a thread; an exception from
    ``read`` is raised where its result would have come. ``close`` (or leaving ``with``) stops the reader early."""

    def __init__(self, read: Callable[[BlockKey], T], keys: Iterable[BlockKey], depth: int = 4) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._read = read
        self._keys = list(keys)
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)
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
            for key in self._keys:
                if not self._offer((key, self._read(key), None)):
                    return
        except BaseException as err:  # handed to the consumer, which raises it
            self._offer((None, None, err))
            return
        self._offer(_DONE)

    def __iter__(self) -> Iterator[tuple[BlockKey, T]]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            key, value, err = item
            if err is not None:
                raise err
            yield key, value

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
