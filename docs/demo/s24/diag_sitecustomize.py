"""Diagnostics only (twenty-fourth session): the twenty-first session's hop stamps (docs/demo/s21_diag/
sitecustomize.py, run first, with this session's experiment switches, exp_sitecustomize.py), plus G (each gRPC call a
server takes: method, time) and L (the decode's admission parts: name, start, wall ms, run ms, wait ms, blocks)."""
import os
_here = os.path.dirname(os.path.abspath(__file__))
exec(open(os.path.join(_here, "exp_sitecustomize.py")).read())
exec(open(os.path.join(_here, "..", "s21_diag", "sitecustomize.py")).read())
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
