"""Experiment only: the launcher's prefill niceness from EXP_PREFILL_NICE."""
import os, sys
if os.environ.get("EXP_PREFILL_NICE") and any("demo" == a for a in sys.argv):
    import mooncake_jax.instance.cluster as c
    c.PREFILL_NICENESS = int(os.environ["EXP_PREFILL_NICE"])
    print("exp: prefill niceness", c.PREFILL_NICENESS, file=sys.stderr)

"""Diagnostics only (twenty-first session): the token feed's hops, on time.perf_counter (one clock for all
processes). D decode step (t0 t1 batch run_ms wait_ms), Q queued-work round, T engine put (rid idx t),
F gateway loop reads the datagram (rid idx t run_ms wait_ms of the loop thread), W SSE chunk yielded (t)."""
import os, time, threading
_out = None
_lock = threading.Lock()
def _w(s):
    global _out
    if _out is None:
        os.makedirs("/tmp/diag21", exist_ok=True)
        _out = open(f"/tmp/diag21/{os.getpid()}.log", "a", buffering=1)
    with _lock:
        _out.write(s)
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
        n = len(self._running); r0, w0 = _ss(); t0 = time.perf_counter()
        out = _dec(self)
        t1 = time.perf_counter(); r1, w1 = _ss()
        _w(f"D {t0:.6f} {t1:.6f} {n} {(r1-r0)/1e6:.3f} {(w1-w0)/1e6:.3f} {threading.get_native_id()}\n")
        return out
    def _start_queued(self):
        n = len(self._waiting); t0 = time.perf_counter(); r0, w0 = _ss()
        out = _sq(self)
        t1 = time.perf_counter(); r1, w1 = _ss()
        if n:
            _w(f"Q {t0:.6f} {t1:.6f} {n} {(r1-r0)/1e6:.3f} {(w1-w0)/1e6:.3f}\n")
        return out
    S.Scheduler._decode, S.Scheduler._start_queued = _decode, _start_queued
    from mooncake_jax.gateway import token_feed as TF
    _send = TF.FeedSender.send
    def send(self, index, token):
        _w(f"T {self._request_id.decode()} {index} {time.perf_counter():.6f}\n")
        return _send(self, index, token)
    TF.FeedSender.send = send
    _decode_dg = TF.decode
    def decode(datagram):
        out = _decode_dg(datagram)
        if out is not None:
            r, w = _ss()
            _w(f"F {out[0]} {out[1]} {time.perf_counter():.6f} {r/1e6:.3f} {w/1e6:.3f} {threading.get_native_id()}\n")
        return out
    TF.decode = decode
except Exception as e:  # noqa
    import sys
    print("diag21 sitecustomize failed:", e, file=sys.stderr)
try:
    from mooncake_jax.gateway import http_server as HS
    _sse0 = HS._sse
    def _sse(body):
        out = _sse0(body)
        if isinstance(body, dict) and body.get("choices"):
            r, w = _ss()
            _w(f"W {body.get('id')} {time.perf_counter():.6f} {r/1e6:.3f} {w/1e6:.3f}\n")
        return out
    HS._sse = _sse
except Exception as e:  # noqa
    import sys
    print("diag21 sitecustomize (W) failed:", e, file=sys.stderr)
try:
    _run0 = threading.Thread.run
    def _run(self):
        _w(f"N {os.getpid()} {threading.get_native_id()} {self.name}\n")
        return _run0(self)
    threading.Thread.run = _run
    _w(f"N {os.getpid()} {threading.get_native_id()} main\n")
except Exception as e:  # noqa
    pass
try:
    import grpc as _grpc
    _server0 = _grpc.server
    class _Cnt(_grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            _w(f"G {details.method} {time.perf_counter():.6f}\n")
            return continuation(details)
    def _server(*a, **k):
        k["interceptors"] = list(k.get("interceptors") or ()) + [_Cnt()]
        return _server0(*a, **k)
    _grpc.server = _server
except Exception as e:  # noqa
    import sys
    print("diag G failed:", e, file=sys.stderr)
if os.environ.get("EXP_SPLIT") and "instance" in sys.argv:
    sys.path.insert(0, "/work/scratch/s24/site"); import exp_split; exp_split.install()
if os.environ.get("EXP_FLOAT_PREFILL") and "instance" in sys.argv:
    sys.path.insert(0, "/work/scratch/s24/site"); import exp_float; exp_float.install()
if os.environ.get("EXP_PREFILL_IDLE") and "instance" in sys.argv and "prefill" in sys.argv:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); print("exp: prefill SCHED_IDLE", file=sys.stderr)
if os.environ.get("EXP_LAUNCHER_NICE") and any("demo" == a for a in sys.argv):
    os.setpriority(os.PRIO_PROCESS, 0, int(os.environ["EXP_LAUNCHER_NICE"])); print("exp: launcher nice", os.getpriority(os.PRIO_PROCESS, 0), file=sys.stderr)
try:
    from mooncake_jax.model import engine as _E
    def _timed(name, f):
        def g(self, *a, **k):
            r0, w0 = _ss(); t0 = time.perf_counter()
            try:
                return f(self, *a, **k)
            finally:
                t1 = time.perf_counter(); r1, w1 = _ss()
                n = len(a[0]) if a and hasattr(a[0], "__len__") else -1
                _w(f"L {name} {t0:.6f} {(t1-t0)*1e3:.3f} {(r1-r0)/1e6:.3f} {(w1-w0)/1e6:.3f} {n}\n")
        return g
    _E.Engine.load_blocks = _timed("load_blocks", _E.Engine.load_blocks)
    _E.Engine.adopt = _timed("adopt", _E.Engine.adopt)
    from mooncake_jax.instance import decode as _D
    for _c in vars(_D).values():
        if isinstance(_c, type) and hasattr(_c, "_admit"):
            _c._admit = _timed("admit", _c._admit)
except Exception as e:  # noqa
    import sys
    print("diag L failed:", e, file=sys.stderr)
