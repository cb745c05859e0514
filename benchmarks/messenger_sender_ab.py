"""A/B of the Messenger's sender with and without its join copy, in one run (issue 15, tenth pass).

A push of small blocks put together sends the messages the put built as they lie (``slots.joined``); a fetch from a
pool that received them in messages sends those as they lie. The A/B, alternated round by round against one peer
process, with the bare streams measured between them (CPU seconds per GB of both processes, GB/s):

* ``push_built``: blocks put into a pool that builds messages (the default), pushed in put order;
* ``push_slots``: the same blocks put into slots (``keeps_built`` forced off), so the push joins them by a copy;
* ``fetch_relayed``: the blocks last pushed, fetched back in push order (the peer sends its kept messages as they lie);
* ``fetch_joined``: the same blocks in an order shifted by one (each message's records then span two kept messages,
  so the peer joins them by a copy);
* ``upload_stream`` / ``raw_download_stream``: the bare references of ``benchmarks/pool.py`` (distinct messages of
  the same size, read and dropped; raw bytes down).

    python benchmarks/messenger_sender_ab.py --block-tokens 16 --rounds 12 --json F
"""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.common import arg_parser, cpu_model, write_json
from benchmarks.pool import cpu_seconds, make_blocks, small_spec
from mooncake_jax.transfer import BlockPool
from mooncake_jax.transfer.messenger import MessengerClient, upload_messages
from mooncake_jax.transfer.peer import PeerProcess
from mooncake_jax.transfer.pieces import message_bytes


def _fail(what: str) -> bool:
    raise RuntimeError(f"{what} did not move every block")


def measure(block_tokens: int, rounds: int) -> dict:
    spec = small_spec(block_tokens)
    n_blocks = 512 if block_tokens == 16 else 96
    blocks = make_blocks(spec, 16)
    built, slotted, sink = (BlockPool(spec, dram_blocks=n_blocks) for _ in range(3))
    slotted._tiers[0].store.keeps_built = lambda n_bytes: False  # every put into a slot, as before this pass
    peer = PeerProcess(spec, dram_blocks=n_blocks)
    total = n_blocks * built.frame_bytes
    size = message_bytes(built.frame_bytes)
    distinct = upload_messages(total, size)
    rounds_done = iter(range(1 << 30))
    pushed: list[int] = []
    cpu: dict[str, list[float]] = {}
    gbps: dict[str, list[float]] = {}
    try:
        with MessengerClient(peer.address, built, timeout_s=300) as push_built, \
                MessengerClient(peer.address, slotted, timeout_s=300) as push_slots, \
                MessengerClient(peer.address, sink, timeout_s=300) as fetcher:

            def costed(call) -> tuple[float, float]:
                """Wall seconds and CPU seconds of both processes of ``call`` alone."""
                before, started = cpu_seconds() + cpu_seconds(peer.process.pid), time.perf_counter()
                call()
                seconds = time.perf_counter() - started
                return seconds, cpu_seconds() + cpu_seconds(peer.process.pid) - before

            def push(client: MessengerClient) -> tuple[float, float]:
                first = next(rounds_done) * n_blocks
                keys = list(range(first, first + n_blocks))
                client.pool.put_many(keys, [blocks[i % len(blocks)] for i in range(n_blocks)])  # not counted
                pushed[:] = keys
                return costed(lambda: client.push(keys).moved == keys or _fail("push"))

            def fetch(shift: int) -> tuple[float, float]:
                for key in sink.keys():  # not counted
                    sink.remove(key)
                keys = pushed[shift:] + pushed[:shift]
                return costed(lambda: fetcher.fetch(keys).moved == keys or _fail("fetch"))

            timed = costed

            trials = {
                "push_built": lambda: push(push_built),
                "fetch_relayed": lambda: fetch(0),
                "push_slots": lambda: push(push_slots),
                "fetch_joined": lambda: fetch(1),
                "upload_stream": lambda: timed(lambda: fetcher.probe_upload(total, piece_bytes=size,
                                                                            messages_to_send=distinct)),
                "raw_download_stream": lambda: timed(lambda: fetcher.probe(total, piece_bytes=size, parse=False)),
            }
            names = list(trials)
            for i in range(rounds + 1):  # one warm-up round
                for name in names if i % 2 else names[2:4] + names[:2] + names[4:]:  # push/fetch pairs alternate
                    seconds, spent = trials[name]()
                    if i:
                        cpu.setdefault(name, []).append(spent / (total / 1e9))
                        gbps.setdefault(name, []).append(total / seconds / 1e9)
    finally:
        peer.stop()
    result: dict = {}
    for name in cpu:
        result[f"{name}_gbps"] = {"median": statistics.median(gbps[name]), "trials": [round(x, 3) for x in gbps[name]]}
        result[f"{name}_cpu_s_per_gb"] = {"median": statistics.median(cpu[name]),
                                          "trials": [round(x, 3) for x in cpu[name]]}
    med = {name: statistics.median(values) for name, values in cpu.items()}
    result.update(
        push_built_cpu_ratio=med["upload_stream"] / med["push_built"],
        push_slots_cpu_ratio=med["upload_stream"] / med["push_slots"],
        fetch_relayed_cpu_ratio=med["raw_download_stream"] / med["fetch_relayed"],
        fetch_joined_cpu_ratio=med["raw_download_stream"] / med["fetch_joined"],
        push_saved_cpu_s_per_gb=med["push_slots"] - med["push_built"],
        fetch_saved_cpu_s_per_gb=med["fetch_joined"] - med["fetch_relayed"],
    )
    return result


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--block-tokens", type=int, choices=(16, 128), default=16)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    started = os.getloadavg()
    result = {"cpu_model": cpu_model(), "block_tokens": args.block_tokens, "load_average_start": started}
    result.update(measure(args.block_tokens, args.rounds))
    result["load_average_end"] = os.getloadavg()
    write_json(result, args.json)


if __name__ == "__main__":
    main()
