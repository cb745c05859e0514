"""Diagnostics only (twentieth session): the seventeenth session's hop stamps (``../s17_diag/sitecustomize.py``,
run first) and three more in the gateway, each with the thread's schedstat (run ms, run-queue wait ms) and id:
P the pump hands a token to the loop (``call_soon_threadsafe``), L the loop runs that callback, Z the SSE chunk
is yielded. ``hops2.py`` joins them; ``schedwho.py`` sets them beside ``perf sched`` records."""
import os, threading, time
from pathlib import Path

exec(compile((Path(__file__).resolve().parent.parent / "s17_diag" / "sitecustomize.py").read_text(),
             "s17_sitecustomize", "exec"))
try:
    from mooncake_jax.gateway import http_server as HS2
    G2 = [c for c in vars(HS2).values() if isinstance(c, type) and hasattr(c, "_pump")][0]
    _pump0 = G2._pump
    class _LoopProxy:
        def __init__(self, loop, queue):
            self._loop, self._q, self.rid, self.n = loop, queue, "?", 0
        def call_soon_threadsafe(self, fn, item):
            name = type(item).__name__
            if name == "_Started":
                self.rid = item.request_id
            idx = getattr(item, "index", None)
            if name == "TokenEvent":
                r, w = _ss()
                _w(f"P {self.rid} {idx} {time.perf_counter():.6f} {r/1e6:.3f} {w/1e6:.3f} {threading.get_native_id()}\n")
                rid = self.rid
                def cb(fn=fn, item=item, rid=rid, idx=idx):
                    r, w = _ss()
                    _w(f"L {rid} {idx} {time.perf_counter():.6f} {r/1e6:.3f} {w/1e6:.3f} {threading.get_native_id()}\n")
                    fn(item)
                return self._loop.call_soon_threadsafe(cb)
            return self._loop.call_soon_threadsafe(fn, item)
    def _pump(self, loop, queue, parse, arrival, cancelled):
        return _pump0(self, _LoopProxy(loop, queue), queue, parse, arrival, cancelled)
    G2._pump = _pump
    _st2 = G2._stream
    async def _stream2(self, request_id, *a, **k):
        n = 0
        async for chunk in _st2(self, request_id, *a, **k):
            r, w = _ss()
            _w(f"Z {request_id} {n} {time.perf_counter():.6f} {r/1e6:.3f} {w/1e6:.3f}\n"); n += 1
            yield chunk
    G2._stream = _stream2
except Exception as e:  # noqa
    import sys; print("diag2 patch failed", e, file=sys.stderr)
