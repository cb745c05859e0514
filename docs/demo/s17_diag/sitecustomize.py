"""Diagnostics only: stamps each token at every hop on its way out, on time.perf_counter (one clock for every
process): T engine put, G servicer get, Y servicer yield (decode process); R gateway pump receive, S SSE chunk
yielded (gateway). D decode steps, Q queued-work rounds."""
import os, time, threading
_out = None
_lock = threading.Lock()
_tl = threading.local()
def _w(s):
    global _out
    if _out is None:
        os.makedirs("/tmp/diag", exist_ok=True)
        _out = open(f"/tmp/diag/{os.getpid()}.log", "a", buffering=1)
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
        _w(f"D {t0:.6f} {t1:.6f} {n} {(r1-r0)/1e6:.3f} {(w1-w0)/1e6:.3f}\n")
        return out
    def _start_queued(self):
        n = len(self._waiting); t0 = time.perf_counter(); r0, w0 = _ss()
        out = _sq(self)
        t1 = time.perf_counter(); r1, w1 = _ss()
        if n:
            _w(f"Q {t0:.6f} {t1:.6f} {n} {(r1-r0)/1e6:.3f} {(w1-w0)/1e6:.3f}\n")
        return out
    S.Scheduler._decode, S.Scheduler._start_queued = _decode, _start_queued
    from mooncake_jax.engine import runner_loop as RL
    _put, _iter = RL.TokenStream.put, RL.TokenStream.__iter__
    def put(self, token):
        self.__dict__.setdefault("_puts", []).append(time.perf_counter())
        return _put(self, token)
    def it(self):
        k = 0
        for tok in _iter(self):
            t = time.perf_counter(); r0, w0 = _ss()
            puts = self.__dict__.get("_puts", [])
            tp = puts[k] if k < len(puts) else 0.0
            k += 1
            _w(f"G {getattr(_tl, 'rid', '?')} {k} {tp:.6f} {t:.6f}\n")
            yield tok
    RL.TokenStream.put, RL.TokenStream.__iter__ = put, it
    from mooncake_jax.instance import decode as DEC
    _Decode = DEC.DecodeService.Decode
    def Decode(self, request, context):
        _tl.rid = request.request_id
        for msg in _Decode(self, request, context):
            if msg.HasField("token"):
                _w(f"Y {request.request_id} {msg.token.index} {time.perf_counter():.6f}\n")
            yield msg
            _tl.rid = request.request_id
    DEC.DecodeService.Decode = Decode
except Exception as e:  # noqa
    pass
try:
    from mooncake_jax.gateway import core as CORE
    _gen = CORE.GatewayCore.generate
    def generate(self, *a, **k):
        rid, events = _gen(self, *a, **k)
        def wrapped():
            n = 0
            for ev in events:
                _w(f"R {rid} {n} {time.perf_counter():.6f}\n"); n += 1
                yield ev
        return rid, wrapped()
    CORE.GatewayCore.generate = generate
    from mooncake_jax.gateway import http_server as HS
    cls = [c for c in vars(HS).values() if isinstance(c, type) and hasattr(c, "_stream")][0]
    _st = cls._stream
    async def _stream(self, request_id, *a, **k):
        n = 0
        async for chunk in _st(self, request_id, *a, **k):
            _w(f"S {request_id} {n} {time.perf_counter():.6f}\n"); n += 1
            yield chunk
    cls._stream = _stream
except Exception as e:  # noqa
    import sys; print("diag gateway patch failed", e, file=sys.stderr)
