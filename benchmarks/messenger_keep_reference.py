"""The push's yardstick against a receiver that keeps what it receives (issue 15, tenth pass).

``benchmarks/pool.py`` sets a push beside a bare upload stream of the same messages whose receiver drops each message
as it arrives, so gRPC's next ``bytes`` reuses the same few MiB of heap, still in cache. A pool keeps what it
receives: at capacity each new message lands in memory an evicted one freed, out of cache. This runs the same bare
stream both ways in one run, alternated (a receiver that drops, one that keeps the last ``--keep`` messages), and
logs GB/s and the CPU seconds per GB of both processes, so the part of the Messenger's gap that any receiving pool
pays can be told from the part that is the Messenger's own.

    python benchmarks/messenger_keep_reference.py --message-bytes 1966736 --messages 102 --json F
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import time
from concurrent import futures

import grpc


def _serve(port_queue: mp.Queue, keep: int) -> None:
    from mooncake_jax.proto import server_options
    from mooncake_jax.transfer.host_memory import keep_freed_buffers

    keep_freed_buffers()  # as a pool's process does
    kept: collections.deque = collections.deque(maxlen=keep)

    def drop(messages, context):
        return sum(1 for _ in messages).to_bytes(8, "little")

    def keep_last(messages, context):
        count = 0
        for message in messages:
            kept.append(message)
            count += 1
        return count.to_bytes(8, "little")

    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe", {
        "Drop": grpc.stream_unary_rpc_method_handler(drop, None, None),
        "Keep": grpc.stream_unary_rpc_method_handler(keep_last, None, None),
    }),))
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _cpu_seconds(pid: int | None = None) -> float:
    if pid is None:
        return time.process_time()
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(message_bytes: int, n_messages: int, keep: int, rounds: int) -> dict:
    from mooncake_jax.proto import channel_options
    from mooncake_jax.transfer.host_memory import keep_freed_buffers

    keep_freed_buffers()
    ports: mp.Queue = mp.Queue()
    server = mp.Process(target=_serve, args=(ports, keep), daemon=True)
    server.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=60)}", options=channel_options())
        calls = {name: channel.stream_unary(f"/probe/{name}") for name in ("Drop", "Keep")}
        messages = [bytes([i % 251]) * message_bytes for i in range(n_messages)]  # distinct, held in memory
        gb = message_bytes * n_messages / 1e9
        cpu: dict[str, list[float]] = {name: [] for name in calls}
        gbps: dict[str, list[float]] = {name: [] for name in calls}
        for i in range(rounds + 2):  # two warm-up rounds
            for name in ("Drop", "Keep") if i % 2 else ("Keep", "Drop"):
                before, started = _cpu_seconds() + _cpu_seconds(server.pid), time.perf_counter()
                calls[name](iter(messages))
                seconds = time.perf_counter() - started
                if i >= 2:
                    cpu[name].append((_cpu_seconds() + _cpu_seconds(server.pid) - before) / gb)
                    gbps[name].append(gb / seconds)
        channel.close()
    finally:
        server.kill()
    result = {f"{name.lower()}_{kind}": {"median": statistics.median(values[name]),
                                         "trials": [round(x, 3) for x in values[name]]}
              for name in ("Drop", "Keep") for kind, values in (("gbps", gbps), ("cpu_s_per_gb", cpu))}
    result["keep_over_drop_gbps"] = result["keep_gbps"]["median"] / result["drop_gbps"]["median"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--message-bytes", type=int, default=1_966_736, help="as the Messenger sends (16-token blocks)")
    parser.add_argument("--messages", type=int, default=102, help="per call (102 x 1,966,736 bytes: 512 blocks)")
    parser.add_argument("--keep", type=int, default=None, help="messages the keeping receiver holds (default: all)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.message_bytes < 1 or args.messages < 1 or args.rounds < 1:
        parser.error("--message-bytes, --messages and --rounds must be >= 1")
    started = os.getloadavg()
    result = measure(args.message_bytes, args.messages, args.keep or args.messages, args.rounds)
    result.update(message_bytes=args.message_bytes, messages=args.messages, load_average_start=started,
                  load_average_end=os.getloadavg(), cpu_model=open("/proc/cpuinfo").read().split("model name")[1]
                  .split("\n")[0].strip(":\t "))
    print(json.dumps({k: (v["median"] if isinstance(v, dict) else v) for k, v in result.items()}))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
