"""The Messenger across a veth pair between two network namespaces, against bare streams over the same link.

    sudo python benchmarks/messenger_netns.py --json docs/pool/messenger_netns.json [--repeats 3] [--quick]

Why: every other Messenger figure is loopback in one namespace, where an offer's address, the kernel's path and
the data plane's listener host are the easy case. Here a Messenger server (and its pools) runs in namespace A at
10.16.0.1 and the client in namespace B at 10.16.0.2, joined by a veth pair, and the socket plane must listen on,
and offer, the address the other side reaches (the client's plane on 10.16.0.2 for a push). Measured per block
size, alternated round by round, medians of ``--repeats``: fetch and push on the socket plane, on the gRPC plane,
and with the default (``auto``: which plane it chose is recorded), beside a bare gRPC stream both ways (the Probe /
ProbeUpload RPCs, the Messenger's message sizes; what ``messenger_ratio`` / ``messenger_push_ratio`` compare to) and
a bare TCP stream both ways (``sendall`` of a 4 MiB buffer / ``recv_into`` a 1 MiB one: the link's limit for a
Python process). GB/s and CPU seconds per GB (both processes). The same trials run over loopback in one namespace in
the same run (``loopback``), so the veth's cost is a ratio measured side by side.

Needs root and ``ip`` (iproute2); without them it prints why and exits 0, writing nothing. The namespaces and veth
are removed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402

from mooncake_jax.transfer import BlockPool, BlockSpec  # noqa: E402

NS_SERVER, NS_CLIENT = "mj16srv", "mj16cli"
VETH_SERVER, VETH_CLIENT = "mj16s", "mj16c"
SERVER_IP, CLIENT_IP = "10.16.0.1", "10.16.0.2"
SMALL = (12, 4, 64)  # the small preset's layers, KV heads, head_dim (benchmarks/pool.py)
TCP_SEND, TCP_RECV = 4 << 20, 1 << 20


def spec_for(block_tokens: int) -> BlockSpec:
    layers, heads, dim = SMALL
    return BlockSpec((layers, 2, block_tokens, heads, dim), np.float32)


def blocks_for(spec: BlockSpec, count: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1 << 16, spec.nbytes // 2, dtype=np.uint16).view(spec.dtype).reshape(spec.shape)
            for _ in range(count)]


def cpu_seconds(pid: int | None = None) -> float:
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the server side: a Messenger for fetches (holding the blocks), one for pushes, a bare TCP endpoint ----------


def tcp_endpoint(host: str) -> int:
    """A bare TCP peer: a connection sends ``b"D" + n`` (this side sends n bytes) or ``b"U" + n`` (it reads n bytes),
    then gets one byte back when done."""
    listener = socket.create_server((host, 0))
    payload = memoryview(bytes(TCP_SEND))
    sink = bytearray(TCP_RECV)

    def serve(conn: socket.socket) -> None:
        with conn:
            head = conn.recv(9, socket.MSG_WAITALL)
            kind, n = head[:1], struct.unpack("<Q", head[1:])[0]
            if kind == b"D":
                while n > 0:
                    conn.sendall(payload[: min(n, TCP_SEND)])
                    n -= min(n, TCP_SEND)
                conn.recv(1)
            else:
                while n > 0:
                    n -= conn.recv_into(sink, min(n, TCP_RECV))
                conn.sendall(b"k")

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


def serve(host: str, block_tokens: int, n_blocks: int) -> None:
    from mooncake_jax.transfer.messenger import MessengerServer

    spec = spec_for(block_tokens)
    held = BlockPool(spec, dram_blocks=n_blocks)
    blocks = blocks_for(spec)
    held.put_many(list(range(n_blocks)), [blocks[i % len(blocks)] for i in range(n_blocks)])
    fetched_from = MessengerServer(held, host=host).start()
    pushed_to = MessengerServer(BlockPool(spec, dram_blocks=n_blocks), host=host).start()
    print(json.dumps({"fetch": fetched_from.address, "push": pushed_to.address, "tcp": tcp_endpoint(host),
                      "pid": os.getpid()}), flush=True)
    sys.stdin.read()  # until the client side is done


# ---- the client side --------------------------------------------------------------------------------------------


def bare_tcp(host: str, port: int, kind: bytes, n: int) -> float:
    with socket.create_connection((host, port)) as conn:
        started = time.perf_counter()
        conn.sendall(kind + struct.pack("<Q", n))
        if kind == b"D":
            sink, left = bytearray(TCP_RECV), n
            while left > 0:
                left -= conn.recv_into(sink, min(left, TCP_RECV))
            conn.sendall(b"k")
        else:
            payload, left = memoryview(bytes(TCP_SEND)), n
            while left > 0:
                conn.sendall(payload[: min(left, TCP_SEND)])
                left -= min(left, TCP_SEND)
            conn.recv(1)
        return n / (time.perf_counter() - started) / 1e9


def measure(server: dict, host: str, data_host: str, block_tokens: int, n_blocks: int, repeats: int) -> dict:
    from mooncake_jax.transfer.messenger import MessengerClient, upload_messages
    from mooncake_jax.transfer.pieces import message_bytes

    spec = spec_for(block_tokens)
    source = BlockPool(spec, dram_blocks=n_blocks)
    sink = BlockPool(spec, dram_blocks=n_blocks)
    blocks = blocks_for(spec)
    n_bytes = n_blocks * source.frame_bytes
    rounds = iter(range(1, 1 << 30))
    clients = {(plane, kind): MessengerClient(server[kind], source if kind == "push" else sink, timeout_s=300,
                                              data_plane=plane, data_host=data_host)
               for plane in ("socket", "grpc", "auto") for kind in ("fetch", "push")}
    chosen = {kind: clients["auto", kind].plane(pushing=kind == "push") for kind in ("fetch", "push")}

    def fetch(plane: str) -> float:
        for key in list(sink.keys()):
            sink.remove(key)
        result = clients[plane, "fetch"].fetch(range(n_blocks))
        assert len(result.moved) == n_blocks
        return result.bytes / result.seconds / 1e9

    def push(plane: str) -> float:
        first = next(rounds) * n_blocks
        keys = list(range(first, first + n_blocks))
        source.put_many(keys, [blocks[i % len(blocks)] for i in range(n_blocks)])
        result = clients[plane, "push"].push(keys)
        assert len(result.moved) == n_blocks
        for key in keys:
            source.remove(key)
        return result.bytes / result.seconds / 1e9

    piece = message_bytes(source.frame_bytes)
    upload = upload_messages(n_bytes, piece)
    probe = clients["grpc", "fetch"]
    trials = {
        "socket_fetch": lambda: fetch("socket"), "socket_push": lambda: push("socket"),
        "grpc_fetch": lambda: fetch("grpc"), "grpc_push": lambda: push("grpc"),
        "auto_fetch": lambda: fetch("auto"), "auto_push": lambda: push("auto"),
        "grpc_stream_down": lambda: probe.probe(n_bytes, piece_bytes=piece) / 1e9,
        "grpc_stream_up": lambda: probe.probe_upload(n_bytes, piece_bytes=piece, messages_to_send=upload) / 1e9,
        "tcp_stream_down": lambda: bare_tcp(host, server["tcp"], b"D", n_bytes),
        "tcp_stream_up": lambda: bare_tcp(host, server["tcp"], b"U", n_bytes),
    }
    for trial in trials.values():  # connections and allocators warm
        trial()
    gb, cpu = {name: [] for name in trials}, {name: [] for name in trials}
    for _ in range(repeats):
        for name, trial in trials.items():
            before = cpu_seconds() + cpu_seconds(server["pid"])
            gb[name].append(trial())
            cpu[name].append((cpu_seconds() + cpu_seconds(server["pid"]) - before) / (n_bytes / 1e9))
    counters = {f"{plane}_{kind}": client.counters.as_dict() for (plane, kind), client in clients.items()}
    assert counters["socket_fetch"]["socket_bytes"] > 0 and counters["grpc_fetch"]["socket_bytes"] == 0
    for client in clients.values():
        client.close()
    med = {name: statistics.median(v) for name, v in gb.items()}
    med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    ratios = {}
    for plane in ("socket", "grpc", "auto"):
        ratios[f"{plane}_fetch_vs_grpc_stream"] = med[f"{plane}_fetch"] / med["grpc_stream_down"]
        ratios[f"{plane}_push_vs_grpc_stream"] = med[f"{plane}_push"] / med["grpc_stream_up"]
        ratios[f"{plane}_fetch_vs_tcp"] = med[f"{plane}_fetch"] / med["tcp_stream_down"]
        ratios[f"{plane}_push_vs_tcp"] = med[f"{plane}_push"] / med["tcp_stream_up"]
    return {"block_bytes": spec.nbytes, "n_blocks": n_blocks, "message_bytes": piece, "auto_chose": chosen,
            "gbps": {k: round(v, 3) for k, v in med.items()},
            "cpu_s_per_gb": {k: round(v, 3) for k, v in med_cpu.items()},
            "ratios": {k: round(v, 3) for k, v in ratios.items()},
            "trials_gbps": {k: [round(x, 3) for x in v] for k, v in gb.items()}, "counters": counters}


def client(args) -> None:
    server = json.loads(args.server)
    print(json.dumps(measure(server, args.host, args.data_host, args.block_tokens, args.n_blocks, args.repeats)),
          flush=True)


# ---- the orchestration ------------------------------------------------------------------------------------------


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def set_up_namespaces() -> None:
    tear_down_namespaces()
    sh("ip", "netns", "add", NS_SERVER)
    sh("ip", "netns", "add", NS_CLIENT)
    sh("ip", "link", "add", VETH_SERVER, "type", "veth", "peer", "name", VETH_CLIENT)
    for ns, dev, ip in ((NS_SERVER, VETH_SERVER, SERVER_IP), (NS_CLIENT, VETH_CLIENT, CLIENT_IP)):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def tear_down_namespaces() -> None:
    for ns in (NS_SERVER, NS_CLIENT):  # deleting a namespace deletes the veth end in it, and so the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_pair(link: str, block_tokens: int, n_blocks: int, repeats: int) -> dict:
    """Server and client processes, in the two namespaces (``veth``) or both in this one (``loopback``)."""
    veth = link == "veth"
    server_host, client_host = (SERVER_IP, CLIENT_IP) if veth else ("127.0.0.1", "127.0.0.1")
    prefix = lambda ns: ["ip", "netns", "exec", ns] if veth else []  # noqa: E731
    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    server = subprocess.Popen([*prefix(NS_SERVER), *me, "--role", "server", "--host", server_host,
                               "--block-tokens", str(block_tokens), "--n-blocks", str(n_blocks)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready = server.stdout.readline()
        if not ready:
            raise RuntimeError(f"the {link} server process ended before it was ready")
        done = subprocess.run([*prefix(NS_CLIENT), *me, "--role", "client", "--server", ready.strip(),
                               "--host", server_host, "--data-host", client_host, "--block-tokens", str(block_tokens),
                               "--n-blocks", str(n_blocks), "--repeats", str(repeats)],
                              capture_output=True, text=True, env=env, timeout=1200)
        if done.returncode:
            raise RuntimeError(f"the {link} client failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a quarter of the data")
    parser.add_argument("--role", choices=("orchestrate", "server", "client"), default="orchestrate",
                        help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--data-host", help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--block-tokens", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--n-blocks", type=int, default=96, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        serve(args.host, args.block_tokens, args.n_blocks)
        return 0
    if args.role == "client":
        client(args)
        return 0
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("messenger_netns: skipped: needs root and iproute2's `ip` to make two network namespaces and a veth "
              f"pair (euid {os.geteuid()}, ip {'found' if shutil.which('ip') else 'not found'})")
        return 0
    scale = 4 if args.quick else 1
    results: dict = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_average_start": os.getloadavg(),
                     "server": f"{SERVER_IP} in netns {NS_SERVER}", "client": f"{CLIENT_IP} in netns {NS_CLIENT}"}
    started = time.perf_counter()
    try:
        set_up_namespaces()
        for label, block_tokens, full_blocks in (("block128", 128, 96), ("block16", 16, 512)):
            n_blocks = max(16, full_blocks // scale)
            for link in ("veth", "loopback"):
                results[f"{label}_{link}"] = run_pair(link, block_tokens, n_blocks, args.repeats)
                print(label, link, results[f"{label}_{link}"]["gbps"], flush=True)
            veth, loop = results[f"{label}_veth"]["gbps"], results[f"{label}_loopback"]["gbps"]
            results[f"{label}_veth_over_loopback"] = {k: round(veth[k] / loop[k], 3) for k in veth}
    finally:
        tear_down_namespaces()
    results["load_average_end"] = os.getloadavg()
    results["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print({k: v for k, v in results.items() if not isinstance(v, dict)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
