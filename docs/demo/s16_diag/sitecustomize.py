"""Diagnostics only: stamps the engine loop's parts on time.perf_counter (one clock for every process)."""
import os, time, threading
_out = None
def _f():
    global _out
    if _out is None:
        os.makedirs("/tmp/diag", exist_ok=True)
        _out = open(f"/tmp/diag/{os.getpid()}.log", "a", buffering=1)
    return _out
def _ss():
    try:
        with open("/proc/thread-self/schedstat") as f:
            a = f.read().split()
        return int(a[0]), int(a[1])
    except OSError:
        return 0, 0
try:
    from mooncake_jax.engine import scheduler as S
    _dec, _sq = S.Scheduler._decode, S.Scheduler._start_queued
    def _decode(self):
        n = len(self._running); r0, w0 = _ss(); c0 = time.process_time(); t0 = time.perf_counter()
        out = _dec(self)
        t1 = time.perf_counter(); r1, w1 = _ss(); c1 = time.process_time()
        _f().write(f"D {t0:.6f} {t1:.6f} {n} {(r1-r0)/1e6:.3f} {(w1-w0)/1e6:.3f} {(c1-c0)*1e3:.3f}\n")
        return out
    def _start_queued(self):
        n = len(self._waiting); t0 = time.perf_counter(); r0, w0 = _ss()
        out = _sq(self)
        t1 = time.perf_counter(); r1, w1 = _ss()
        if n:
            _f().write(f"Q {t0:.6f} {t1:.6f} {n} {(r1-r0)/1e6:.3f} {(w1-w0)/1e6:.3f} {len(self._waiting)}\n")
        return out
    S.Scheduler._decode, S.Scheduler._start_queued = _decode, _start_queued
except Exception as e:  # noqa
    pass
