"""Scratch prototype only: tokens from the decode engine thread straight to the gateway's event loop over a UDP
datagram (THIN_PORT), bypassing the gRPC handler, the gateway's stream reader and pump. The old path still runs
(its token events are dropped in the pump), so the gateway's work is unchanged; only the token's way is shorter."""
import os, socket, sys, time
PORT = int(os.environ.get("THIN_PORT", "0"))
if PORT:
    try:
        from mooncake_jax.engine import runner_loop as RL
        from mooncake_jax.instance import decode as DEC
        _start = DEC.DecodeService._start
        _sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        _sock.setblocking(False)
        def start(self, seq, request, stream, source=None):
            stream._thin = (request.request_id.encode(), [0])
            return _start(self, seq, request, stream, source)
        DEC.DecodeService._start = start
        _put = RL.TokenStream.put
        def put(self, token):
            thin = getattr(self, "_thin", None)
            if thin is not None:
                thin[1][0] += 1
                try:
                    _sock.sendto(b"%s %d %d" % (thin[0], thin[1][0], token), ("127.0.0.1", PORT))
                except OSError:
                    pass
            return _put(self, token)
        RL.TokenStream.put = put
    except Exception as e:
        print("thin decode patch failed", e, file=sys.stderr)
    try:
        import threading
        from mooncake_jax.gateway import http_server as HS
        from mooncake_jax.gateway.stream import TokenEvent
        G = HS._Gateway
        _pump0 = G._pump
        queues = {}
        state = {"sock": None}
        def on_readable():
            s = state["sock"]
            while True:
                try:
                    data = s.recv(256)
                except BlockingIOError:
                    return
                rid, idx, tok = data.split()
                q = queues.get(rid.decode())
                if q is not None:
                    q.put_nowait(TokenEvent(int(tok), int(idx), 0.0, ""))
        lock = threading.Lock()
        def ensure(loop):
            with lock:
                if state["sock"] is None:
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    s.bind(("127.0.0.1", PORT)); s.setblocking(False)
                    state["sock"] = s
                    loop.call_soon_threadsafe(loop.add_reader, s.fileno(), on_readable)
        class Proxy:
            def __init__(self, loop, queue):
                self._loop, self._q, self.rid = loop, queue, None
            def call_soon_threadsafe(self, fn, item):
                name = type(item).__name__
                if name == "_Started":
                    self.rid = item.request_id.removeprefix("cmpl-")
                    queues[self.rid] = self._q
                elif name == "TokenEvent" and item.index >= 1:
                    return None  # came by datagram
                elif name in ("Summary", "_End") or isinstance(item, BaseException):
                    if name == "_End":
                        queues.pop(self.rid, None)
                return self._loop.call_soon_threadsafe(fn, item)
        def _pump(self, loop, queue, parse, arrival, cancelled):
            ensure(loop)
            return _pump0(self, Proxy(loop, queue), queue, parse, arrival, cancelled)
        G._pump = _pump
    except Exception as e:
        print("thin gateway patch failed", e, file=sys.stderr)
