"""Where a push loses against the bare upload stream: CPU seconds per GB of each process apart (the sender, this
process; the receiving peer), rounds alternated (issue 15, eleventh pass).

    python benchmarks/messenger_push_split.py --tokens 16 --rounds 8 --json /tmp/push_split.json

A round is a push of fresh blocks (``small`` preset; 512 16-token or 96 128-token blocks, put just before and not
counted) to a ``PeerProcess`` whose pool is at capacity, then the same bytes in the same message sizes by the
upload stream ``benchmarks/pool.py`` compares a push with (distinct prebuilt messages, read raw and dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402
from pool import cpu_seconds, make_blocks, small_spec  # noqa: E402

from mooncake_jax.transfer import BlockPool
from mooncake_jax.transfer.messenger import MessengerClient, upload_messages
from mooncake_jax.transfer.peer import PeerProcess
from mooncake_jax.transfer.pieces import message_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, choices=(16, 128), default=16)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    n_blocks = 512 if args.tokens == 16 else 96
    spec = small_spec(args.tokens)
    blocks = make_blocks(spec, 16)
    source = BlockPool(spec, dram_blocks=n_blocks)
    peer = PeerProcess(spec, dram_blocks=n_blocks)
    n_bytes = n_blocks * source.frame_bytes
    figures: dict[str, dict[str, list[float]]] = {}
    load_start = os.getloadavg()
    try:
        with MessengerClient(peer.address, source, timeout_s=300) as client:
            rounds = iter(range(1 << 30))
            piece = message_bytes(source.frame_bytes)
            distinct = upload_messages(n_bytes, piece)

            def measured(run) -> tuple[float, float, float]:
                mine, theirs, started = cpu_seconds(), cpu_seconds(peer.process.pid), time.perf_counter()
                run()
                return (time.perf_counter() - started, cpu_seconds() - mine,
                        cpu_seconds(peer.process.pid) - theirs)

            def push() -> tuple[float, float, float]:
                first = next(rounds) * n_blocks
                keys = list(range(first, first + n_blocks))
                source.put_many(keys, [blocks[i % len(blocks)] for i in range(n_blocks)])
                return measured(lambda: client.push(keys))

            def upload() -> tuple[float, float, float]:
                return measured(lambda: client.probe_upload(n_bytes, piece_bytes=piece, messages_to_send=distinct))

            for _ in range(2):  # the peer's pool reaches its capacity; allocators and connection warm
                push()
                upload()
            for _ in range(args.rounds):
                for name, trial in (("push", push), ("upload", upload)):
                    wall, sender, receiver = trial()
                    entry = figures.setdefault(name, {"gbps": [], "sender_cpu_s_per_gb": [],
                                                      "receiver_cpu_s_per_gb": []})
                    entry["gbps"].append(round(n_bytes / wall / 1e9, 3))
                    entry["sender_cpu_s_per_gb"].append(round(sender / (n_bytes / 1e9), 3))
                    entry["receiver_cpu_s_per_gb"].append(round(receiver / (n_bytes / 1e9), 3))
    finally:
        peer.stop()
        source.close()
    results = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_average_start": load_start,
               "tokens": args.tokens, "message_bytes": piece, "bytes_per_round": n_bytes,
               "load_average_end": os.getloadavg()}
    for name, entry in figures.items():
        results[name] = {key: {"median": statistics.median(values), "trials": values} for key, values in entry.items()}
        print(name, {key: round(statistics.median(values), 3) for key, values in entry.items()})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
