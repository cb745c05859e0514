"""Seconds a thread spent compiling XLA programs (tracing, lowering, compiling or loading one from the persistent
cache) within a span of its time, read from JAX's own monitoring events.

Why: a prefill instance's ``SlowdownMeter`` compares each request's measured compute with its cost model, and the
Conductor scales every prediction for that instance by the result. A request that is the first to reach a program
(a shape the warm-up did not compile, or any shape after a restart that skipped the warm-up) spends seconds in the
compiler on a 2-core host, many times its model; counted as compute, one such request made the meter report the
instance 8-27x slower than its model, and the Conductor refused every request for the meter's window. Compiling is not a
slowdown of the model: the meter is fed the compute less the compile time measured here.

JAX reports each compile stage as a time span on the thread that does it (the caller of the jitted function: the
engine loop). Spans nest (a jitted function traced inside another's trace), so the seconds are the length of their
union, clipped to the span asked about.
"""

from __future__ import annotations

import collections
import threading
import time

import jax

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",  # compiling, or loading from the persistent cache
})
"""JAX's monitoring events (``jax._src.dispatch``) that time a stage of making a program; each reports the start
and end (``time.time()``) of its stage."""

SPANS_KEPT = 4096
"""Spans remembered per thread: a warm-up compiles a few hundred programs of three stages each; serving's spans are
read within a request of being recorded."""


class CompileClock:
    """Compile spans per thread, recorded from JAX's monitoring events once ``install``-ed (``clock()`` installs the
    process's one)."""

    def __init__(self):
        self._spans: dict[int, collections.deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def install(self) -> "CompileClock":
        jax.monitoring.register_event_time_span_listener(self._on_span)
        return self

    def _on_span(self, event: str, start: float, end: float, **_) -> None:
        if event not in COMPILE_EVENTS:
            return
        thread = threading.get_ident()
        with self._lock:
            spans = self._spans.get(thread)
            if spans is None:
                spans = self._spans[thread] = collections.deque(maxlen=SPANS_KEPT)
            spans.append((start, end))

    def seconds(self, since: float, until: float | None = None, thread: int | None = None) -> float:
        """Seconds ``thread`` (default: the calling one) spent compiling between wall-clock times ``since`` and
        ``until`` (``time.time()``; default: now)."""
        until = time.time() if until is None else until
        thread = threading.get_ident() if thread is None else thread
        with self._lock:
            spans = sorted((max(s, since), min(e, until)) for s, e in self._spans.get(thread, ()) if e > since
                           and s < until)
        total, reach = 0.0, since
        for start, end in spans:  # the union's length: each span counts only beyond what earlier ones covered
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total


_clock: CompileClock | None = None
_clock_lock = threading.Lock()


def clock() -> CompileClock:
    """This process's compile clock (listening from the first call on)."""
    global _clock
    with _clock_lock:
        if _clock is None:
            _clock = CompileClock().install()
        return _clock
