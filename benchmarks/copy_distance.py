"""What the kernel's copy out of the page cache costs by where its destination lies in a page, and the SSD tier's
get into staging buffers at such places.

    python benchmarks/copy_distance.py --json /tmp/copy_distance.json [--rounds 5]

Why (docs/benchmarks/pool.md, eighteenth pass): on the AMD EPYC (Zen 3) measured, ``rep movsb`` (the kernel's copy
to user memory, and glibc's ``memcpy`` at these sizes) costs 4-8x its CPU when the destination lies 1-31 bytes past
the source modulo 4096; a shard's records start page-aligned in their files and numpy's large arrays start 16
bytes into a page, so SSD gets into such a buffer took that path. Figures, CPU seconds per GB (this process; the
medians of ``--rounds`` alternated rounds, every round kept):

* ``preadv``: 384 KiB reads of a page-cached file into a buffer at each page offset, and ``np.copyto`` of a
  page-aligned 384 KiB array into the same places (glibc's copy);
* ``ssd_get``: ``BlockPool.get_many`` of an SSD-only pool, 16 blocks a call, into a staging buffer at each page
  offset, for the 16-token (384 KiB) and the 70B 512-token (160 MiB) blocks of ``benchmarks/pool.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402
from pool import BATCH, at_page_offset, llama70b_spec, make_blocks, small_spec  # noqa: E402

from mooncake_jax.transfer import BlockPool

RECORD = 384 << 10
OFFSETS = (0, 1, 8, 16, 31, 32, 48, 64, 2048, 4080)
GET_OFFSETS = (0, 16, 64, 2048)


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "trials": [round(v, 4) for v in values]}


def measure_copies(directory: Path, rounds: int, n: int = 64) -> dict:
    path = directory / "page-cached.bin"
    path.write_bytes(np.ones(RECORD * n, np.uint8).tobytes())
    source = at_page_offset((RECORD,), np.uint8, 0)
    places = {offset: at_page_offset((RECORD,), np.uint8, offset) for offset in OFFSETS}
    cpu: dict[str, list[float]] = {f"{way}_{o}": [] for o in OFFSETS for way in ("preadv", "memcpy")}
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(rounds):
            for offset, out in places.items():
                started = time.process_time()
                for i in range(n):
                    os.preadv(fd, [out], i * RECORD)
                cpu[f"preadv_{offset}"].append((time.process_time() - started) / (RECORD * n / 1e9))
                started = time.process_time()
                for _ in range(n):
                    np.copyto(out, source)
                cpu[f"memcpy_{offset}"].append((time.process_time() - started) / (RECORD * n / 1e9))
    finally:
        os.close(fd)
        path.unlink()
    return {f"{name}_cpu_s_per_gb": summary(values) for name, values in cpu.items()}


def measure_gets(directory: Path, rounds: int) -> dict:
    out: dict = {}
    sections = (("block16", small_spec(16), 512, BATCH), ("llama70b_block512", llama70b_spec(), 4, 1))
    for label, spec, n_ops, size in sections:
        blocks = make_blocks(spec, 2 if size == 1 else 16)
        root = directory / label
        pool = BlockPool(spec, dram_blocks=0, ssd_path=root)
        pool.put_many(range(n_ops), [blocks[i % len(blocks)] for i in range(n_ops)])
        del blocks
        stagings = {offset: at_page_offset((size, *spec.shape), spec.dtype, offset) for offset in GET_OFFSETS}
        pool.get_many(range(size), stagings[16])  # writes settled, the streaming copy compiled
        cpu: dict[int, list[float]] = {offset: [] for offset in GET_OFFSETS}
        rate: dict[int, list[float]] = {offset: [] for offset in GET_OFFSETS}
        n_bytes = n_ops * spec.nbytes
        for _ in range(rounds):
            for offset, staging in stagings.items():
                started, cpu_started = time.perf_counter(), time.process_time()
                for b in range(n_ops // size):
                    pool.get_many(range(b * size, (b + 1) * size), staging)
                cpu[offset].append((time.process_time() - cpu_started) / (n_bytes / 1e9))
                rate[offset].append(n_bytes / (time.perf_counter() - started) / 1e9)
        pool.close()
        shutil.rmtree(root)
        out[label] = {**{f"ssd_get_{o}_cpu_s_per_gb": summary(v) for o, v in cpu.items()},
                      **{f"ssd_get_{o}_gbps": summary(v) for o, v in rate.items()}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_average_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as scratch:
        results["copies"] = measure_copies(Path(scratch), args.rounds)
        results["gets"] = measure_gets(Path(scratch), args.rounds)
    results["load_average_end"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print(json.dumps({k: v["median"] for k, v in results["copies"].items()}))
    for label, figures in results["gets"].items():
        print(label, json.dumps({k: v["median"] for k, v in figures.items()}))
    print(results["load_average_start"], results["load_average_end"])


if __name__ == "__main__":
    main()
