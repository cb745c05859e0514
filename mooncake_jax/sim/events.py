"""The virtual clock: a heap of timed callbacks that refuses to move time backwards.

Ties run in the order they were scheduled, so a run is deterministic. An ``observer`` sees every event time
(tests use it to check the clock never goes back; it is None otherwise and costs nothing).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventQueue:
    """Pending events ``(time, order, callback, args)``; ``now`` is the time of the event being run."""

    def __init__(self, start: float = 0.0, observer: Callable[[float], None] | None = None):
        self.now = start
        self._heap: list = []
        self._order = 0
        self._observer = observer

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, time: float, callback: Callable, *args) -> None:
        """Run ``callback(*args)`` at ``time`` (not before ``now``)."""
        if time < self.now:
            raise RuntimeError(f"event scheduled at {time} before the clock ({self.now})")
        self._order += 1
        heapq.heappush(self._heap, (time, self._order, callback, args))

    def run_next(self) -> None:
        time, _, callback, args = heapq.heappop(self._heap)
        if time < self.now:
            raise RuntimeError(f"clock would go back from {self.now} to {time}")
        self.now = time
        if self._observer is not None:
            self._observer(time)
        callback(*args)

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None
