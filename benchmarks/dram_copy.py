"""How a block's copy-and-hash costs against memcpy, in CPU seconds per GB of this thread, one process, variants
alternated round by round (issue 15, eleventh pass: why the DRAM tier writes slots with streaming stores).

    python benchmarks/dram_copy.py --json /tmp/dram_copy.json [--rounds 7]

For a 160 MiB block (the llama2-70b shape's 512-token block) and for 16- and 128-token blocks of the ``small``
preset copied into rotating slots as a put does, and out of them into a reused staging buffer as a get does:
``np.copyto`` whole (glibc streams copies above its non-temporal threshold only), ``np.copyto`` chunk by chunk,
the streaming copy (``stream_copy.py``) whole, the tier's copy-and-hash with streaming stores at several chunk
sizes, and the same with ``np.copyto`` (the copy before this pass: each copied chunk hashed from cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402

from mooncake_jax.transfer import checksum
from mooncake_jax.transfer.stream_copy import address, streaming_copy

LARGE = 160 << 20


def cpu(fn) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


def chunked(copy_chunk, dst: np.ndarray, src: np.ndarray, chunk: int):
    def run() -> None:
        for start in range(0, src.size, chunk):
            copy_chunk(dst[start : start + chunk], src[start : start + chunk])

    return run


def stream_and_hash(dst: np.ndarray, src: np.ndarray, chunk: int):
    """The tier's streaming copy-and-hash at ``chunk`` bytes (``checksum.STREAM_CHUNK_BYTES`` in the tier)."""
    def run() -> None:
        saved = checksum.STREAM_CHUNK_BYTES
        checksum.STREAM_CHUNK_BYTES = chunk
        try:
            checksum.copy_with_checksum(dst, src)
        finally:
            checksum.STREAM_CHUNK_BYTES = saved

    return run


def large_block(rounds: int) -> dict:
    stream = streaming_copy()
    sources = [np.random.default_rng(i).integers(0, 256, LARGE, dtype=np.uint8) for i in range(2)]
    places = [np.ones(LARGE, np.uint8) for _ in range(3)]
    seconds: dict[str, list[float]] = {}
    for r in range(rounds):
        src, dst = sources[r % 2], places[r % 3]
        variants = {
            "memcpy_whole": lambda: np.copyto(dst, src),
            "memcpy_1mib_chunks": chunked(np.copyto, dst, src, 1 << 20),
            "stream_copy_whole": lambda: stream(address(dst), address(src), LARGE),
            "copy_then_hash_1mib (before)": lambda: checksum.copy_with_checksum(dst, src, stream=False),
        }
        for kib in (128, 256, 512, 1024, 2048):
            variants[f"stream_then_hash_{kib}kib"] = stream_and_hash(dst, src, kib << 10)
        for name, fn in variants.items():
            seconds.setdefault(name, []).append(cpu(fn) / (LARGE / 1e9))
    return {name: {"median": statistics.median(v), "trials": [round(x, 4) for x in v]} for name, v in seconds.items()}


def slots_case(block_bytes: int, n_slots: int, rounds: int) -> dict:
    """Puts: 16 distinct source blocks into rotating slots; gets: rotating slots into a reused staging buffer."""
    blocks = [np.random.default_rng(i).integers(0, 256, block_bytes, dtype=np.uint8) for i in range(16)]
    slab = np.ones((n_slots, block_bytes + 128), np.uint8)
    slots = [slab[i, 128:] for i in range(n_slots)]
    staging = np.ones((16, block_bytes), np.uint8)
    n_ops = 2 * n_slots
    seconds: dict[str, list[float]] = {}
    ways = {"memcpy": lambda d, s: np.copyto(d, s),
            "copy_then_hash (before)": lambda d, s: checksum.copy_with_checksum(d, s, stream=False),
            "stream_then_hash": lambda d, s: checksum.copy_with_checksum(d, s, stream=True)}
    for r in range(rounds):
        for name, way in ways.items():
            put = cpu(lambda: [way(slots[(i + 7 * r) % n_slots], blocks[i % 16]) for i in range(n_ops)])
            get = cpu(lambda: [way(staging[i % 16], slots[(7 * i + r) % n_slots]) for i in range(n_ops)])
            seconds.setdefault(f"put {name}", []).append(put / (n_ops * block_bytes / 1e9))
            seconds.setdefault(f"get {name}", []).append(get / (n_ops * block_bytes / 1e9))
    return {name: {"median": statistics.median(v), "trials": [round(x, 4) for x in v]} for name, v in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if streaming_copy() is None:
        raise SystemExit("the streaming copy cannot be built here")
    results = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_average_start": os.getloadavg(),
               "unit": "CPU seconds per GB (this thread)",
               "block_70b_160mib": large_block(args.rounds),
               "block16_384kib_512_slots": slots_case(384 << 10, 512, args.rounds),
               "block128_3mib_96_slots": slots_case(3 << 20, 96, args.rounds),
               "load_average_end": os.getloadavg()}
    for section, figures in results.items():
        if isinstance(figures, dict):
            print(section, {name: round(f["median"], 3) for name, f in figures.items()})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
