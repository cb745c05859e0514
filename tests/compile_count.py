"""A test's own count of the programs JAX compiles (or loads from the persistent cache) while it is in use: a
listener on JAX's monitoring events, independent of the engine's compile clock that some tests check."""

from __future__ import annotations

import jax


class CompileCount:
    """``with CompileCount() as c: ...``: ``c.n`` backend compiles in the block (every program, helpers included)."""

    def __init__(self):
        self.n = 0

    def __call__(self, event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)
