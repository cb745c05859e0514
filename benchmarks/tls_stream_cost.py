"""What TLS would cost the socket data plane: a bare TCP stream on loopback, plain against wrapped in Python's
``ssl`` (a self-signed certificate of the kind ``proto/tls.py`` is given), GB/s and CPU seconds per GB of both ends
(one process, two threads), medians of 5 alternated rounds of 512 MiB.

    python benchmarks/tls_stream_cost.py [--json PATH]

Why: the socket plane refuses TLS and ``data_plane="auto"`` keeps gRPC where TLS is on (sixteenth pass); this is
the figure behind not wrapping the data socket instead (an ``SSLSocket`` also has no ``sendmsg``: one ``sendall``
per record, and a copy into the TLS record layer).
"""
import json, os, socket, ssl, statistics, sys, threading, time, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_roles import self_signed  # noqa: E402
N = 512 << 20
CHUNK = 4 << 20
tmp = Path(tempfile.mkdtemp())
cert, key = self_signed(tmp)
server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); server_ctx.load_cert_chain(cert, key)
client_ctx = ssl.create_default_context(cafile=str(cert))

def one(wrap: bool) -> tuple[float, float]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    def recv():
        conn, _ = listener.accept()
        if wrap:
            conn = server_ctx.wrap_socket(conn, server_side=True)
        buf = bytearray(1 << 20); left = N
        while left > 0:
            left -= conn.recv_into(buf, min(left, 1 << 20))
        conn.sendall(b"k"); conn.close()
    t = threading.Thread(target=recv); t.start()
    c = socket.create_connection(("127.0.0.1", port))
    if wrap:
        c = client_ctx.wrap_socket(c, server_hostname="127.0.0.1")
    payload = memoryview(os.urandom(CHUNK))
    cpu0, t0 = time.process_time(), time.perf_counter()
    left = N
    while left > 0:
        c.sendall(payload[: min(left, CHUNK)]); left -= CHUNK
    c.recv(1)
    secs, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    t.join(); c.close(); listener.close()
    return N / secs / 1e9, cpu / (N / 1e9)

res = {"plain": [], "tls": []}
for _ in range(5):
    for k in res:
        res[k].append(one(k == "tls"))
out = {k: {"gbps": statistics.median(x[0] for x in v), "cpu_s_per_gb": statistics.median(x[1] for x in v),
           "trials": [[round(a, 3), round(b, 3)] for a, b in v]} for k, v in res.items()}
out["load_average"] = os.getloadavg()
out["tls_over_plain_cpu"] = out["tls"]["cpu_s_per_gb"] / out["plain"]["cpu_s_per_gb"]
text = json.dumps(out, indent=1)
if "--json" in sys.argv:
    Path(sys.argv[sys.argv.index("--json") + 1]).write_text(text)
print(text)
