"""Latency of each message of a server-streaming gRPC call on loopback, as the gateway reads a decode instance's
tokens: the channel's default reading (a polling thread of the channel receives each message and wakes the
reader) against ``SingleThreadedUnaryStream`` (the reading thread receives it itself), alternated in one run
(each round in the other order).

    python benchmarks/stream_latency.py --json /tmp/stream_latency.json [--busy] [--rounds 4]

A server process yields a message every ``--gap-ms`` (default 1.7: the demo decode instance's step at batch 1 on
the AMD EPYC measured) stamped with ``time.perf_counter`` (the host's monotonic clock, the same in every process);
the client stamps its arrival. ``--busy``: a Python thread of the client process keeps the interpreter lock busy
meanwhile, as the gateway's event loop and its other streams do; the client runs with the serving processes'
switch interval (``instance/main.py``; ``--switch-interval-ms`` another). Figures: latency percentiles (ms) of
every message but each call's first five, per way, and the ratio of the tails (default over single-threaded).
"""

from __future__ import annotations

import multiprocessing
import struct
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import grpc.experimental
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, cpu_model, load_average, write_json  # noqa: E402

from mooncake_jax.instance.backend import INSTANCE_CHANNEL_OPTIONS  # noqa: E402
from mooncake_jax.instance.main import SWITCH_INTERVAL_S  # noqa: E402

METHOD = "/latency.Stream/Messages"
WARM_MESSAGES = 5


def serve(ports, gap_s: float) -> None:
    """The server process: ``Messages`` streams the number of messages asked for, ``gap_s`` apart, each the
    ``perf_counter`` at which it was yielded."""

    def messages(request, context):
        for _ in range(struct.unpack("<I", request)[0]):
            time.sleep(gap_s)
            yield struct.pack("<d", time.perf_counter())

    handler = grpc.method_handlers_generic_handler(
        "latency.Stream", {"Messages": grpc.unary_stream_rpc_method_handler(messages)})
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((handler,))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def latencies_ms(port: int, options: tuple, count: int) -> np.ndarray:
    """One call of ``count`` messages on a fresh channel with ``options``: each message's latency but the first few."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=list(options))
    try:
        call = channel.unary_stream(METHOD)(struct.pack("<I", count))
        arrived = [(time.perf_counter(), message) for message in call]
    finally:
        channel.close()
    return np.array([(t - struct.unpack("<d", m)[0]) * 1e3 for t, m in arrived[WARM_MESSAGES:]])


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--messages", type=int, default=600, help="messages per call")
    p.add_argument("--gap-ms", type=float, default=1.7)
    p.add_argument("--busy", action="store_true", help="a Python thread keeps the client's interpreter lock busy")
    p.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_S * 1e3,
                   help="the client's interpreter lock switch interval (default: the serving processes')")
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    spawn = multiprocessing.get_context("spawn")  # a server process without this one's threads
    ports = spawn.Queue()
    server = spawn.Process(target=serve, args=(ports, args.gap_ms / 1e3), daemon=True)
    server.start()
    port = ports.get(timeout=60)
    stop = threading.Event()
    if args.busy:
        def spin() -> None:
            while not stop.is_set():
                sum(range(2000))

        threading.Thread(target=spin, daemon=True).start()
    ways = {"default": (), "single_threaded": INSTANCE_CHANNEL_OPTIONS}
    got: dict[str, list] = {way: [] for way in ways}
    load = load_average()
    try:
        for r in range(args.rounds):
            for way, options in list(ways.items())[:: 1 if r % 2 == 0 else -1]:
                got[way].append(latencies_ms(port, options, args.messages))
    finally:
        stop.set()
        server.terminate()
    out = {"cpu_model": cpu_model(), "load_average": load, "busy": args.busy, "gap_ms": args.gap_ms,
           "switch_interval_ms": args.switch_interval_ms,
           "messages": int(sum(len(a) for a in got["default"]))}
    for way, arrays in got.items():
        a = np.concatenate(arrays)
        for q in (50, 90, 99, 99.9):
            out[f"{way}_p{q}_ms".replace(".", "_")] = round(float(np.percentile(a, q)), 3)
    for q in ("p99", "p99_9"):
        out[f"{q}_default_over_single_threaded"] = round(out[f"default_{q}_ms"] / out[f"single_threaded_{q}_ms"], 2)
    write_json(out, args.json)


if __name__ == "__main__":
    main()
