"""KVCache pool and Messenger throughput against this machine's physical baselines, measured in the same run.

    python benchmarks/pool.py --json /tmp/pool.json [--quick] [--skip-layerwise | --full-layerwise] [--tiers-only]

The default run finishes within 10 minutes on 2 cores (the layer-wise section on 1K and 2K-token prompts; the
1K-16K sweep behind ``--full-layerwise``). The headline figures are flat at the top level of the JSON
(``dram_put_ratio``, ``dram_get_ratio``, ``ssd_put_ratio``, ``ssd_get_ratio``, ``messenger_ratio``,
``messenger_push_ratio``, ``transfer_engine_gbps``, ``layerwise_speedup``), with the CPU model and load average;
a DRAM or SSD ratio there is the worst over the block sizes measured (the goal holds for each).

Figures (issue 4, Measure):
* block keys: milliseconds per 1000 tokens for a 128K-token prompt;
* memcpy GB/s (the blocks copied into preallocated, already-touched memory) and the pool's DRAM put/get GB/s in
  steady state (the pool full, every put evicting), in batches of 16 blocks (``put_many``, and ``get_many`` into
  a reused staging buffer as an engine feeding a device would): ``dram_put_ratio`` / ``dram_get_ratio``
  (goal >= 0.6); beside memcpy (``np.copyto``: glibc streams only copies above its non-temporal threshold, 99 MiB
  on the Intel Xeon measured, so the 70B block's and no other) the same copies with streaming stores
  (``stream_copy_gbps``, the copy the tier itself writes slots with): ``dram_put_vs_stream_copy_ratio``,
  ``dram_get_vs_stream_copy_ratio``, ``stream_copy_vs_memcpy_ratio``;
* raw sequential file-write and -read GB/s (one file, no fsync, same bytes and directory; read into a reused
  page-aligned buffer) and the SSD tier's put and get GB/s (an SSD-only pool, ``put_many`` of 16 until every write
  is done, ``get_many`` of 16 into a page-aligned staging buffer, ``STAGING_PAGE_OFFSET``):
  ``ssd_put_ratio`` / ``ssd_get_ratio`` (goal >= 0.7); beside them a raw write of the same bytes with
  ``O_DIRECT`` (copied into a 4 MiB aligned buffer, as ``dd oflag=direct`` does) and the tier's put with its
  shards written ``O_DIRECT`` (``ssd_direct_io=True``):
  ``ssd_put_vs_direct_raw_ratio``, ``ssd_direct_io_put_ratio`` (against the buffered raw write),
  ``ssd_direct_io_put_vs_direct_raw_ratio``; and each SSD ratio taken round by round, a trial over its baseline's
  trial of the same round (``ssd_put_paired_ratio``, ``ssd_get_paired_ratio``: medians of those), which a slow
  episode hitting both trials of a round does not move;
* Messenger GB/s between two processes on loopback (a fetch into an empty DRAM pool; a push) on its default data
  plane, as a user gets it (``data_plane="auto"``: the socket plane between two current builds without TLS; which
  plane moved the bytes is ``messenger_data_plane`` in the JSON, checked against the clients' counters), and a bare gRPC
  stream of the same bytes in the same message sizes from the same peer process and connection (its Probe
  RPC, one prebuilt message sent again and again, read as protobuf ``BlockPiece`` messages; the message size is
  the one the Messenger sends, ``message_bytes`` in the JSON: five 16-token blocks joined, one 128-token block):
  ``messenger_ratio`` (goal >= 0.85); a push against a bare stream the other way, the same bytes and message sizes
  sent to the peer by a client-streaming call as a push is (its ProbeUpload RPC), distinct prebuilt messages held
  in memory as the push's blocks are, read raw and dropped there: ``messenger_push_ratio``
  (``messenger_push_one_message_ratio``: against one message sent again and again from cache, the reference
  before issue 15's ninth pass; ``messenger_push_download_ratio``: against the download stream). The receiving
  pools only receive (the device plane's trials have their own sink and peer). For context, measured alongside
  too: the same stream read as raw bytes, the way the Messenger reads (``messenger_raw_stream_ratio``), the upload
  stream parsed by protobuf at the peer as the download reference's client parses (``messenger_push_parsed_ratio``:
  like for like with ``messenger_ratio``), and in
  pieces of at most 2 MiB, the piece size before blocks travelled whole (``grpc_stream_2mib_gbps``: this
  machine's loopback moves 1.5 MiB messages faster than 3 MiB ones, but sending a block whole saves a copy at
  each end);
* the same fetch and push over the gRPC plane (``data_plane="grpc"``, the default before the sixteenth pass; a
  peer process and sink of its own): ``grpc_plane_fetch_ratio`` / ``grpc_plane_push_ratio`` against the same
  references (and their ``*_cpu_ratio``);
* the same fetch and push over the device-native data plane (``data_plane="jax"``: records pulled as device
  arrays with ``jax.experimental.transfer``, gRPC for control): ``jax_plane_fetch_gbps`` / ``jax_plane_push_gbps``
  and their ratios to the bare gRPC stream;
* the socket data plane (records sent with ``sendmsg`` of views of the stored records over a plain TCP
  connection, received into a reused staging buffer and stored verified; gRPC for control): when it is the default
  plane's choice, its figures are the headline ones, also under ``socket_plane_fetch_ratio`` /
  ``socket_plane_push_ratio`` (against the same bare gRPC streams as ``messenger_ratio`` /
  ``messenger_push_ratio``), and ``socket_plane_push_wire_ratio`` against a bare socket stream of the same bytes (its ProbePull RPC: the same
  records sent as they lie, received into the peer's staging buffer and dropped: ``socket_wire_upload_gbps``);
* layer-wise vs serialized prefill + store latency on the ``small`` preset, 1K to 16K-token prompts with half of
  their blocks already in the pool: ``layerwise_speedup`` = serialized / layer-wise time (best of the trials).

Each figure and its baseline are measured alternately ``--repeats`` times and reported as medians (the machine
is shared, single trials are noisy), with every trial kept in the JSON. The SSD and Messenger trials also log the
CPU seconds per GB they cost (``*_cpu_s_per_gb``; a transfer counts both processes) and the same ratios in CPU
(``ssd_put_cpu_ratio`` ... ``messenger_push_cpu_ratio``: baseline CPU over tier CPU), which the load of a shared
machine moves far less than it moves GB/s: what a ratio could reach with the cores to itself.

Blocks have the ``small`` preset's geometry (12 layers, K and V, 4 KV heads, head_dim 64, float32) at 128 tokens
per block (3 MiB) and at the engine's 16 tokens per block (384 KiB, where per-call overhead shows); the DRAM and
SSD tiers also with one 512-token block of the llama2-70b shape (80 layers, 8 KV heads, head_dim 128, bfloat16:
160 MiB).
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
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model  # noqa: E402

from mooncake_jax.blocks import block_keys
from mooncake_jax.transfer import BlockPool, BlockSpec
from mooncake_jax.transfer.messenger import MessengerClient, upload_messages
from mooncake_jax.transfer.peer import PeerProcess
from mooncake_jax.transfer.pieces import message_bytes, piece_bytes_for
from mooncake_jax.transfer.pool import page_aligned_empty
from mooncake_jax.transfer.shard_writer import ALIGN, PIECE_BYTES, aligned_buffer
from mooncake_jax.transfer.stream_copy import address, streaming_copy

SMALL_LAYERS, SMALL_KV_HEADS, SMALL_HEAD_DIM = 12, 4, 64
BATCH = 16  # blocks per put_many / get_many: a request's new blocks go in together


def small_spec(block_tokens: int) -> BlockSpec:
    return BlockSpec((SMALL_LAYERS, 2, block_tokens, SMALL_KV_HEADS, SMALL_HEAD_DIM), np.float32)


def llama70b_spec() -> BlockSpec:
    return BlockSpec((80, 2, 512, 8, 128), "bfloat16")


def make_blocks(spec: BlockSpec, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1 << 16, spec.nbytes // 2, dtype=np.uint16).view(spec.dtype).reshape(spec.shape)
            for _ in range(count)]


STAGING_PAGE_OFFSET = 0
"""Where the SSD get's staging buffer starts in a page: page-aligned, as the raw read's buffer, as
``BlockPool.get_many`` allocates blocks itself (``page_aligned_empty``). Fixed, because the kernel's copy costs 4-8x
its CPU on the AMD EPYC measured when its destination lies 1-31 bytes past the page-cache source modulo a page (a raw
read at such a distance 0.36-0.37 CPU s/GB against 0.08): left to the allocator (glibc puts a large array 16 bytes
into a page before a pool's ``host_memory`` settings, anywhere in the heap after), either figure of a run could land
there or not (the likely cause of a 16-token get at 0.17 CPU s/GB in one run and 0.48 in the next, the figure a
staging buffer 16 bytes into a page gives: docs/benchmarks/pool.md, eighteenth pass). The tier reads a destination
at such a distance through a bounce buffer: ``benchmarks/copy_distance.py`` measures it."""


def at_page_offset(shape: tuple[int, ...], dtype, offset: int) -> np.ndarray:
    """A touched (every byte 1) C-contiguous array of ``shape`` and ``dtype`` starting ``offset`` bytes into a page
    (``pool.page_aligned_empty``, first touched here rather than in a timed copy)."""
    out = page_aligned_empty(shape, dtype, offset)
    out.view(np.uint8).fill(1)
    return out


def gbps(n_bytes: int, seconds: float) -> float:
    return n_bytes / seconds / 1e9


def each(n: int, op: Callable[[int], object]) -> Callable[[], None]:
    """``op(0) ... op(n - 1)``, results dropped at once (a consumer keeps a block only as long as it uses it)."""

    def loop() -> None:
        for i in range(n):
            op(i)

    return loop


def batch(keys: list[int], blocks: list[np.ndarray], index: int, size: int = BATCH) -> tuple[list[int], list]:
    """Batch ``index`` of ``size`` keys, with blocks cycling through ``blocks``."""
    span = range(index * size, (index + 1) * size)
    return [keys[i % len(keys)] for i in span], [blocks[i % len(blocks)] for i in span]


_TIMED_CPU: list[float] = []
"""CPU seconds of this process in each ``timed`` region so far (``costed(..., timed_only=True)`` sums them)."""


def timed(fn: Callable[[], object]) -> float:
    started, cpu = time.perf_counter(), time.process_time()
    fn()
    seconds = time.perf_counter() - started
    _TIMED_CPU.append(time.process_time() - cpu)
    return seconds


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) used so far by this process, or by process ``pid`` (read from
    Linux's /proc; NaN elsewhere, so no CPU figure of a transfer counts one process only)."""
    if pid is None:
        return time.process_time()
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return float("nan")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def costed(trials: dict[str, Callable[[], float]], n_bytes: int, pids: tuple[int, ...] = (),
           timed_only: bool = False, set_up: Callable[[], float] = lambda: 0.0
           ) -> tuple[dict[str, Callable[[], float]], dict[str, list[float]]]:
    """The trials, each also logging the CPU seconds per GB of ``n_bytes`` it cost (this process and ``pids``,
    the whole trial less what ``set_up`` says its preparation took, a running total of CPU seconds; ``timed_only``:
    this process in the trial's ``timed`` regions alone, so the setup of a read, writing what it reads, is not
    counted): unlike GB/s on a shared machine, CPU per byte hardly moves with the load, so its ratio to the
    baseline's says whether a change did less work."""
    log: dict[str, list[float]] = {name: [] for name in trials}

    def spent() -> float:
        if timed_only:
            return sum(_TIMED_CPU)
        return cpu_seconds() + sum(cpu_seconds(pid) for pid in pids) - set_up()

    def logging(name: str, trial: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            before = spent()
            figure = trial()
            log[name].append((spent() - before) / (n_bytes / 1e9))
            return figure

        return run

    return {name: logging(name, trial) for name, trial in trials.items()}, log


def with_cpu(figures: dict[str, dict], log: dict[str, list[float]]) -> dict[str, dict]:
    """``figures`` plus each logged trial's CPU seconds per GB (``*_cpu_s_per_gb``: median and trials)."""
    for name, values in log.items():
        if values:
            figures[name.replace("_gbps", "_cpu_s_per_gb")] = {
                "median": statistics.median(values), "trials": [round(x, 3) for x in values]}
    return figures


def alternate(repeats: int, **trials: Callable[[], float]) -> dict[str, dict]:
    """Run each named trial (returning GB/s) in turn, ``repeats`` rounds; median and all values per name."""
    values: dict[str, list[float]] = {name: [] for name in trials}
    for _ in range(repeats):
        for name, trial in trials.items():
            values[name].append(trial())
    return {name: {"median": statistics.median(v), "trials": [round(x, 3) for x in v]} for name, v in values.items()}


# ---- block keys -----------------------------------------------------------------------------------------


def measure_block_keys() -> dict:
    tokens = np.random.default_rng(0).integers(0, 128256, 128 * 1024)
    result = {}
    for block_size in (16, 512):
        seconds = min(timed(lambda: block_keys(tokens, block_size)) for _ in range(5))
        result[f"ms_per_1k_tokens_block{block_size}"] = round(seconds * 1e3 / (tokens.size / 1000), 5)
    return result


# ---- DRAM tier vs memcpy --------------------------------------------------------------------------------


def measure_dram(spec: BlockSpec, blocks: list[np.ndarray], capacity: int, n_ops: int, repeats: int,
                 size: int = BATCH) -> dict:
    """Steady state: the pool is filled first, so every measured put evicts one block and reuses its memory."""
    slots = [np.empty_like(blocks[0]) for _ in range(capacity)]
    for slot in slots:
        slot.fill(1)  # touch the pages, as a warm pool has
    pool = BlockPool(spec, dram_blocks=capacity)
    next_key = iter(range(1, 1 << 62))
    for _ in range(capacity):
        pool.put(next(next_key), blocks[0])
    n_bytes = n_ops * spec.nbytes

    def memcpy() -> float:
        return gbps(n_bytes, timed(each(n_ops, lambda i: np.copyto(slots[i % capacity], blocks[i % len(blocks)]))))

    stream = streaming_copy()
    places = [address(slot) for slot in slots]
    sources = [address(block) for block in blocks]

    def stream_copy() -> float:  # the same copies with streaming stores, as the tier's copy writes (context)
        return gbps(n_bytes, timed(each(n_ops, lambda i: stream(places[i % capacity], sources[i % len(blocks)],
                                                                spec.nbytes))))

    def put() -> float:
        keys = [next(next_key) for _ in range(n_ops)]
        return gbps(n_bytes, timed(each(n_ops // size, lambda b: pool.put_many(*batch(keys, blocks, b, size)))))

    staging = np.empty((size, *spec.shape), spec.dtype)
    staging.fill(1)

    def get() -> float:  # into a reused staging buffer, as an engine feeding a device would
        held = pool.keys()
        return gbps(n_bytes, timed(each(n_ops // size, lambda b: pool.get_many(batch(held, blocks, b, size)[0],
                                                                                 staging))))

    trials = {"memcpy_gbps": memcpy, "dram_put_gbps": put, "dram_get_gbps": get}
    if stream is not None:
        trials["stream_copy_gbps"] = stream_copy
    trials, log = costed(trials, n_bytes, timed_only=True)
    figures = with_cpu(alternate(repeats, **trials), log)
    assert pool.counters()["dram"].corrupt == 0 and pool.counters()["dram"].evictions >= n_ops
    pool.close()
    return figures


# ---- SSD tier vs raw file writes ------------------------------------------------------------------------


def measure_ssd(spec: BlockSpec, blocks: list[np.ndarray], n_ops: int, repeats: int, directory: Path,
                size: int = BATCH) -> dict:
    n_bytes = n_ops * spec.nbytes
    read_buffer = at_page_offset((size, spec.nbytes), np.uint8, 0)  # as large as the tier's staging buffer

    def raw_read() -> float:  # the same bytes as one file, written just before (in the page cache, as the tier's)
        path = directory / "raw-read.bin"
        with open(path, "wb") as out:
            for i in range(n_ops):
                out.write(blocks[i % len(blocks)])

        def read() -> None:
            with open(path, "rb", buffering=0) as source:
                for i in range(n_ops):
                    source.readinto(read_buffer[i % size])

        seconds = timed(read)
        path.unlink()
        return gbps(n_bytes, seconds)

    def raw_write() -> float:
        path = directory / "raw.bin"

        def write() -> None:
            with open(path, "wb") as out:
                for i in range(n_ops):
                    out.write(blocks[i % len(blocks)])

        seconds = timed(write)
        path.unlink()
        return gbps(n_bytes, seconds)

    def raw_write_direct() -> float:  # the same bytes with O_DIRECT, copied into an aligned buffer as dd does
        path = directory / "raw-direct.bin"
        staging = aligned_buffer(PIECE_BYTES)

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
            offset = 0
            for i in range(n_ops):
                block = blocks[i % len(blocks)].reshape(-1).view(np.uint8)
                for start in range(0, block.size, PIECE_BYTES):
                    piece = block[start : start + PIECE_BYTES]
                    np.copyto(staging[: piece.size], piece)
                    offset += os.pwrite(fd, staging[: -(-piece.size // ALIGN) * ALIGN], offset)
            os.close(fd)

        seconds = timed(write)
        path.unlink()
        return gbps(n_bytes, seconds)

    def put(direct_io: bool = False) -> float:
        root = directory / "ssd"
        pool = BlockPool(spec, dram_blocks=0, ssd_path=root, ssd_direct_io=direct_io)
        keys = list(range(n_ops))
        seconds = timed(each(n_ops // size, lambda b: pool.put_many(*batch(keys, blocks, b, size))))
        pool.close()
        shutil.rmtree(root)
        return gbps(n_bytes, seconds)

    def get() -> float:
        root = directory / "ssd-read"
        pool = BlockPool(spec, dram_blocks=0, ssd_path=root)
        pool.put_many(range(n_ops), [blocks[i % len(blocks)] for i in range(n_ops)])
        staging = at_page_offset((size, *spec.shape), spec.dtype, STAGING_PAGE_OFFSET)
        seconds = timed(each(n_ops // size, lambda b: pool.get_many(range(b * size, (b + 1) * size), staging)))
        pool.close()
        shutil.rmtree(root)
        return gbps(n_bytes, seconds)

    raw_write()  # the first write to a fresh filesystem area is slow for everyone: do not measure it
    direct = {"raw_write_direct_gbps": raw_write_direct, "ssd_put_direct_io_gbps": lambda: put(direct_io=True)}
    trials, log = costed({"raw_write_gbps": raw_write, "ssd_put_gbps": put, "raw_read_gbps": raw_read,
                          "ssd_get_gbps": get, **(direct if hasattr(os, "O_DIRECT") else {})}, n_bytes,
                         timed_only=True)
    figures = with_cpu(alternate(repeats, **trials), log)
    figures["raw_read_buffer_page_offset"], figures["ssd_get_staging_page_offset"] = 0, STAGING_PAGE_OFFSET
    for name, (tier, baseline) in (("ssd_put_paired_ratio", ("ssd_put_gbps", "raw_write_gbps")),
                                   ("ssd_get_paired_ratio", ("ssd_get_gbps", "raw_read_gbps"))):
        figures[name] = paired(figures[tier]["trials"], figures[baseline]["trials"])
    return figures


def paired(tier: list[float], baseline: list[float]) -> dict:
    """The tier's trial over the baseline's trial of the same round, median and all: a slow episode of the shared
    machine that hits both trials of a round (their CPU per GB up 2.5-4x alike, docs/benchmarks/pool.md ninth SSD
    pass) cancels out here, where it moves one median of five and not the other."""
    per_round = [t / b for t, b in zip(tier, baseline)]
    return {"median": statistics.median(per_round), "trials": [round(x, 3) for x in per_round]}


# ---- Messenger between two processes vs a bare gRPC stream ----------------------------------------------


def measure_messenger(spec: BlockSpec, blocks: list[np.ndarray], n_blocks: int, repeats: int) -> dict:
    """Fetch: the peer's DRAM pool into ours; push: ours into the peer's, new keys every round. The push's receiving
    pool is at capacity from earlier rounds, so it evicts as a serving pool does. Each receiving pool only receives,
    as a decode instance's pool mostly does: the device plane's trials have a sink and a peer of their own (its rows
    land in slots, and a pool holding free slots copies into them what it could keep as received)."""
    source = BlockPool(spec, dram_blocks=n_blocks)
    sink = BlockPool(spec, dram_blocks=n_blocks)
    jax_sink = BlockPool(spec, dram_blocks=n_blocks)
    grpc_sink = BlockPool(spec, dram_blocks=n_blocks)
    default_peer = PeerProcess(spec, dram_blocks=n_blocks)
    jax_peer = PeerProcess(spec, dram_blocks=n_blocks)
    grpc_peer = PeerProcess(spec, dram_blocks=n_blocks)
    rounds = iter(range(1 << 30))
    set_up_cpu = [0.0]  # a trial's preparation (this process): left out of its CPU per GB, as out of its GB/s

    def preparing(prepare: Callable[[], list[int]]) -> list[int]:
        started = cpu_seconds()
        keys = prepare()
        set_up_cpu[0] += cpu_seconds() - started
        return keys

    try:
        # the Messenger as a user gets it: the default data plane (``data_plane="auto"``), with a peer and sink of
        # its own; the gRPC plane's figures kept beside it (``grpc_plane_*``), as the device plane's
        with MessengerClient(default_peer.address, source, timeout_s=300) as pusher, MessengerClient(
            default_peer.address, sink, timeout_s=300
        ) as fetcher, MessengerClient(jax_peer.address, source, timeout_s=300, data_plane="jax") as jax_pusher, \
                MessengerClient(jax_peer.address, jax_sink, timeout_s=300, data_plane="jax") as jax_fetcher, \
                MessengerClient(grpc_peer.address, source, timeout_s=300, data_plane="grpc") as grpc_pusher, \
                MessengerClient(grpc_peer.address, grpc_sink, timeout_s=300, data_plane="grpc") as grpc_fetcher:
            planes = {"fetch": fetcher.plane(), "push": pusher.plane(pushing=True)}

            def fresh_keys() -> list[int]:
                first = next(rounds) * n_blocks
                keys = list(range(first, first + n_blocks))
                source.put_many(keys, [blocks[i % len(blocks)] for i in range(n_blocks)])
                return keys

            pushed: dict[str, list[int]] = {}  # the keys last pushed to each peer: what it holds to fetch

            def push(client: MessengerClient = pusher) -> float:
                keys = pushed[client.address] = preparing(fresh_keys)
                result = client.push(keys)
                assert len(result.moved) == n_blocks
                return gbps(result.bytes, result.seconds)

            def held_by_peer(client: MessengerClient) -> list[int]:
                keys = [key for key, held in zip(pushed[client.address], client.has(pushed[client.address])) if held]
                for key in client.pool.keys():
                    client.pool.remove(key)
                return keys

            def fetch(client: MessengerClient = fetcher) -> float:
                result = client.fetch(preparing(lambda: held_by_peer(client)))
                assert len(result.moved) == n_blocks
                return gbps(result.bytes, result.seconds)

            def stream(piece_bytes: int, parse: bool = True) -> Callable[[], float]:
                return lambda: fetcher.probe(n_blocks * source.frame_bytes, piece_bytes=piece_bytes, parse=parse) / 1e9

            # the same bytes in the same message sizes as a fetch or push sends: several small blocks to a message
            same_pieces = message_bytes(source.frame_bytes)
            # the push's reference sends the same bytes as it does, distinct messages read from memory (as the
            # push reads its blocks), not one message from cache again and again (kept beside it: *_one_message)
            distinct = upload_messages(n_blocks * source.frame_bytes, same_pieces)
            # the socket plane's bare stream: the same bytes as records of their own in memory, sent as they lie and
            # received into the peer's staging buffer, dropped there (no pool, no checks)
            wire_records = [bytes([i % 251]) * source.record_bytes for i in range(n_blocks)]
            trials = {
                "grpc_stream_gbps": stream(same_pieces),
                "messenger_fetch_gbps": fetch,
                "messenger_push_gbps": push,
                "grpc_raw_stream_gbps": stream(same_pieces, parse=False),
                "grpc_upload_stream_gbps": lambda: fetcher.probe_upload(
                    n_blocks * source.frame_bytes, piece_bytes=same_pieces, messages_to_send=distinct) / 1e9,
                "grpc_upload_stream_one_message_gbps": lambda: fetcher.probe_upload(n_blocks * source.frame_bytes,
                                                                                    piece_bytes=same_pieces) / 1e9,
                "grpc_parsed_upload_stream_gbps": lambda: fetcher.probe_upload(
                    n_blocks * source.frame_bytes, piece_bytes=same_pieces, parse=True) / 1e9,
                "grpc_stream_2mib_gbps": stream(piece_bytes_for(source.frame_bytes, 2 << 20)),
                "jax_plane_fetch_gbps": lambda: fetch(jax_fetcher),
                "jax_plane_push_gbps": lambda: push(jax_pusher),
                "grpc_plane_fetch_gbps": lambda: fetch(grpc_fetcher),
                "grpc_plane_push_gbps": lambda: push(grpc_pusher),
                "socket_wire_upload_gbps": lambda: pusher.probe_pull(wire_records) / 1e9,
            }
            push()  # the peers hold blocks to fetch from now on
            push(jax_pusher)
            push(grpc_pusher)
            for trial in trials.values():  # warm both processes' allocators and connections
                trial()
            trials, log = costed(trials, n_blocks * source.frame_bytes,
                                 pids=(default_peer.process.pid, jax_peer.process.pid, grpc_peer.process.pid),
                                 set_up=lambda: set_up_cpu[0])
            figures = with_cpu(alternate(repeats, **trials), log)
            for kind, plane in planes.items():  # the default plane's figures under that plane's keys too
                if plane == "socket":
                    for unit in ("gbps", "cpu_s_per_gb"):
                        figures[f"socket_plane_{kind}_{unit}"] = figures[f"messenger_{kind}_{unit}"]
            figures["counters"] = {"fetcher": fetcher.counters.as_dict(), "pusher": pusher.counters.as_dict(),
                                   "grpc_fetcher": grpc_fetcher.counters.as_dict(),
                                   "grpc_pusher": grpc_pusher.counters.as_dict()}
            if planes["fetch"] == "socket":  # the plane named is the plane that moved the bytes
                assert fetcher.counters.socket_bytes == fetcher.counters.bytes_received > 0
            if planes["push"] == "socket":
                assert pusher.counters.socket_bytes == pusher.counters.bytes_sent > 0
            figures["messenger_data_plane"] = planes["fetch"] if len(set(planes.values())) == 1 else (
                f"fetch={planes['fetch']},push={planes['push']}")
            figures["message_bytes"] = same_pieces
            return figures
    finally:
        default_peer.stop()
        jax_peer.stop()
        grpc_peer.stop()


# ---- layer-wise prefill (issue 4 item 3) ----------------------------------------------------------------


def measure_layerwise_prefill(lengths: tuple[int, ...], repeats: int, prefix_fraction: float = 0.5) -> dict:
    """Prefill + store latency, layer-wise vs serialized, on the ``small`` preset (float32, 16-token blocks).

    Each prompt has ``prefix_fraction`` of its blocks already in the DRAM pool (loaded into the device layer by
    layer) and the rest computed and stored back; a fresh random tail per trial keeps the stored part new.
    """
    from tqdm import tqdm

    import mooncake_jax as mj
    from mooncake_jax.model.engine import Engine
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.transfer.offload import LAYERWISE, SERIALIZED, LayerwisePrefill, pool_prefix, request_keys

    model = mj.LLM("small", num_pages=2).model
    cfg = model.cfg
    engine = Engine(model, prefill_chunk_size=2048, num_pages=2 + 2 * max(lengths) // cfg.block_size)
    pool = BlockPool(BlockSpec(cfg.block_shape(), np.float32))
    offloads = {mode: LayerwisePrefill(engine, mode) for mode in (LAYERWISE, SERIALIZED)}

    def prefill(mode, seq):  # read the prefix from the pool, prefill, store the new blocks (as an instance does)
        prefix = pool_prefix(pool, seq, cfg.block_size)
        _, new_blocks = offloads[mode].prefill(seq, prefix)
        pool.put_many(request_keys(seq, cfg.block_size)[0 if prefix is None else len(prefix):], new_blocks)

    rng = np.random.default_rng(0)
    out: dict = {"model": "small", "prefix_fraction": prefix_fraction, "block_tokens": cfg.block_size}
    for n in tqdm(lengths, desc="layer-wise prefill"):
        prefix = rng.integers(0, cfg.vocab_size, int(n * prefix_fraction) // 16 * 16).tolist()
        warm = engine.new_sequence(prefix + [1], SamplingParams(max_new_tokens=1))
        prefill(SERIALIZED, warm)  # the prefix blocks land in the pool
        engine.release(warm)
        times: dict[str, list[float]] = {LAYERWISE: [], SERIALIZED: []}
        for trial in range(repeats + 1):
            for mode in offloads:
                seq = engine.new_sequence(prefix + rng.integers(0, cfg.vocab_size, n - len(prefix)).tolist(),
                                          SamplingParams(max_new_tokens=1))
                t = time.perf_counter()
                prefill(mode, seq)
                if trial:  # the first round compiles
                    times[mode].append(time.perf_counter() - t)
                engine.release(seq)
        best = {mode: min(ts) for mode, ts in times.items()}
        out[f"{n}_layerwise_s"] = round(best[LAYERWISE], 4)
        out[f"{n}_serialized_s"] = round(best[SERIALIZED], 4)
        out[f"{n}_layerwise_speedup"] = round(best[SERIALIZED] / best[LAYERWISE], 3)
    out["layerwise_speedup"] = out[f"{max(lengths)}_layerwise_speedup"]
    return out


# ---- main -----------------------------------------------------------------------------------------------


def ratios(med: dict[str, float]) -> dict[str, float]:
    """Each tier or transfer figure over its baseline, for the figures a section measured."""
    pairs = {
        "dram_put_ratio": ("dram_put_gbps", "memcpy_gbps"),
        "dram_get_ratio": ("dram_get_gbps", "memcpy_gbps"),
        "dram_put_vs_stream_copy_ratio": ("dram_put_gbps", "stream_copy_gbps"),
        "dram_get_vs_stream_copy_ratio": ("dram_get_gbps", "stream_copy_gbps"),
        "stream_copy_vs_memcpy_ratio": ("stream_copy_gbps", "memcpy_gbps"),
        "ssd_put_ratio": ("ssd_put_gbps", "raw_write_gbps"),
        "ssd_get_ratio": ("ssd_get_gbps", "raw_read_gbps"),
        "ssd_put_vs_direct_raw_ratio": ("ssd_put_gbps", "raw_write_direct_gbps"),
        "ssd_direct_io_put_ratio": ("ssd_put_direct_io_gbps", "raw_write_gbps"),
        "ssd_direct_io_put_vs_direct_raw_ratio": ("ssd_put_direct_io_gbps", "raw_write_direct_gbps"),
        "messenger_ratio": ("messenger_fetch_gbps", "grpc_stream_gbps"),
        "messenger_push_ratio": ("messenger_push_gbps", "grpc_upload_stream_gbps"),  # the same method kind
        "messenger_push_download_ratio": ("messenger_push_gbps", "grpc_stream_gbps"),
        "messenger_push_one_message_ratio": ("messenger_push_gbps", "grpc_upload_stream_one_message_gbps"),
        "messenger_push_one_message_cpu_ratio": ("grpc_upload_stream_one_message_cpu_s_per_gb",
                                                 "messenger_push_cpu_s_per_gb"),
        "messenger_raw_stream_ratio": ("messenger_fetch_gbps", "grpc_raw_stream_gbps"),
        # push against an upload stream that its receiver parses as messenger_ratio's does (like for like with it)
        "messenger_push_parsed_ratio": ("messenger_push_gbps", "grpc_parsed_upload_stream_gbps"),
        "messenger_raw_stream_cpu_ratio": ("grpc_raw_stream_cpu_s_per_gb", "messenger_fetch_cpu_s_per_gb"),
        "messenger_push_parsed_cpu_ratio": ("grpc_parsed_upload_stream_cpu_s_per_gb", "messenger_push_cpu_s_per_gb"),
        # the gRPC plane (data_plane="grpc"; the default before the sixteenth pass) against the same references
        "grpc_plane_fetch_ratio": ("grpc_plane_fetch_gbps", "grpc_stream_gbps"),
        "grpc_plane_push_ratio": ("grpc_plane_push_gbps", "grpc_upload_stream_gbps"),
        "grpc_plane_fetch_cpu_ratio": ("grpc_stream_cpu_s_per_gb", "grpc_plane_fetch_cpu_s_per_gb"),
        "grpc_plane_push_cpu_ratio": ("grpc_upload_stream_cpu_s_per_gb", "grpc_plane_push_cpu_s_per_gb"),
        "jax_plane_fetch_ratio": ("jax_plane_fetch_gbps", "grpc_stream_gbps"),
        "jax_plane_push_ratio": ("jax_plane_push_gbps", "grpc_stream_gbps"),
        # the socket data plane against the same bare gRPC streams as messenger_ratio / messenger_push_ratio, and
        # its push against a bare stream of its own wire (the same bytes, socket to staging buffer, dropped)
        "socket_plane_fetch_ratio": ("socket_plane_fetch_gbps", "grpc_stream_gbps"),
        "socket_plane_push_ratio": ("socket_plane_push_gbps", "grpc_upload_stream_gbps"),
        "socket_plane_push_wire_ratio": ("socket_plane_push_gbps", "socket_wire_upload_gbps"),
        "socket_plane_fetch_cpu_ratio": ("grpc_stream_cpu_s_per_gb", "socket_plane_fetch_cpu_s_per_gb"),
        "socket_plane_push_cpu_ratio": ("grpc_upload_stream_cpu_s_per_gb", "socket_plane_push_cpu_s_per_gb"),
        "socket_plane_push_wire_cpu_ratio": ("socket_wire_upload_cpu_s_per_gb", "socket_plane_push_cpu_s_per_gb"),
        # the same pairs in CPU seconds per GB, baseline over tier (both processes for a transfer; for the tiers,
        # the timed region alone: a put until its writes are done, a get without the writing before it)
        "dram_put_cpu_ratio": ("memcpy_cpu_s_per_gb", "dram_put_cpu_s_per_gb"),
        "dram_get_cpu_ratio": ("memcpy_cpu_s_per_gb", "dram_get_cpu_s_per_gb"),
        "dram_put_vs_stream_copy_cpu_ratio": ("stream_copy_cpu_s_per_gb", "dram_put_cpu_s_per_gb"),
        "ssd_put_cpu_ratio": ("raw_write_cpu_s_per_gb", "ssd_put_cpu_s_per_gb"),
        "ssd_get_cpu_ratio": ("raw_read_cpu_s_per_gb", "ssd_get_cpu_s_per_gb"),
        "messenger_cpu_ratio": ("grpc_stream_cpu_s_per_gb", "messenger_fetch_cpu_s_per_gb"),
        "messenger_push_cpu_ratio": ("grpc_upload_stream_cpu_s_per_gb", "messenger_push_cpu_s_per_gb"),
    }
    return {name: med[a] / med[b] for name, (a, b) in pairs.items() if a in med and b in med}


def run(quick: bool, repeats: int, directory: Path, layerwise: str = "default", tiers_only: bool = False,
        only: str | None = None) -> dict:
    """All sections; ``layerwise`` is ``"skip"``, ``"default"`` (1K and 2K tokens) or ``"full"`` (1K-16K);
    ``tiers_only``: the DRAM and SSD sections alone (no Messenger, no layer-wise prefill); ``only`` (``"dram"``,
    ``"ssd"``, ``"messenger"``): that section alone on the blocks it applies to."""
    scale = 4 if quick else 1
    started = time.perf_counter()
    results: dict = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_average_start": os.getloadavg(),
                     "block_keys": measure_block_keys()}
    for label, block_tokens, full_blocks in (("block128", 128, 96), ("block16", 16, 512)):
        n_blocks = max(BATCH, full_blocks // scale // BATCH * BATCH)
        spec = small_spec(block_tokens)
        blocks = make_blocks(spec, 16)
        section = {"spec": spec.describe(), "block_bytes": spec.nbytes}
        if only in (None, "dram"):
            section.update(measure_dram(spec, blocks, capacity=n_blocks, n_ops=2 * n_blocks, repeats=repeats))
        if only in (None, "ssd"):
            section.update(measure_ssd(spec, blocks, n_ops=n_blocks, repeats=repeats, directory=directory))
        if not tiers_only and only in (None, "messenger"):
            section.update(measure_messenger(spec, blocks, n_blocks=n_blocks, repeats=repeats))
        results[label] = section
        section["done_at_s"] = round(time.perf_counter() - started, 1)
    spec = llama70b_spec()  # one 160 MiB block per call, as a 70B prefill hands over one 512-token block
    blocks = make_blocks(spec, 2) if only != "messenger" else []
    section = {"spec": spec.describe(), "block_bytes": spec.nbytes}
    if only in (None, "dram"):
        section.update(measure_dram(spec, blocks, capacity=3, n_ops=6 // min(scale, 2), repeats=repeats, size=1))
    if only in (None, "ssd"):
        section.update(measure_ssd(spec, blocks, n_ops=4 // min(scale, 2), repeats=repeats, directory=directory,
                                   size=1))
    results["llama70b_block512"] = section
    section["done_at_s"] = round(time.perf_counter() - started, 1)
    del blocks
    for label in ("block128", "block16", "llama70b_block512"):
        section = results[label]
        medians = {k: v["median"] for k, v in section.items() if isinstance(v, dict) and "median" in v}
        section["ratios"] = ratios(medians)
        section["ratios"].update({k: m for k, m in medians.items() if k.endswith("_paired_ratio")})
    if layerwise != "skip" and not tiers_only:
        lengths = (1024, 2048) if layerwise == "default" else (1024, 2048, 4096, 8192, 16384)
        results["layerwise_prefill"] = measure_layerwise_prefill(lengths[:1] if quick else lengths,
                                                                 repeats=1 if quick or layerwise == "default" else 2)
    sections = [results[label]["ratios"] for label in ("block128", "block16", "llama70b_block512")]
    for name in ("dram_put_ratio", "dram_get_ratio", "ssd_put_ratio", "ssd_get_ratio", "messenger_ratio",
                 "messenger_push_ratio", "dram_put_cpu_ratio", "dram_get_cpu_ratio", "ssd_put_cpu_ratio",
                 "ssd_get_cpu_ratio", "messenger_cpu_ratio", "messenger_push_cpu_ratio", "messenger_raw_stream_ratio",
                 "messenger_push_parsed_ratio", "messenger_raw_stream_cpu_ratio", "messenger_push_parsed_cpu_ratio",
                 "messenger_push_one_message_ratio", "messenger_push_one_message_cpu_ratio",
                 "ssd_put_vs_direct_raw_ratio",
                 "ssd_direct_io_put_ratio",
                 "ssd_direct_io_put_vs_direct_raw_ratio", "ssd_put_paired_ratio", "ssd_get_paired_ratio",
                 "dram_put_vs_stream_copy_ratio", "dram_get_vs_stream_copy_ratio",
                 "socket_plane_fetch_ratio", "socket_plane_push_ratio", "socket_plane_push_wire_ratio",
                 "socket_plane_fetch_cpu_ratio", "socket_plane_push_cpu_ratio", "socket_plane_push_wire_cpu_ratio",
                 "grpc_plane_fetch_ratio", "grpc_plane_push_ratio", "grpc_plane_fetch_cpu_ratio",
                 "grpc_plane_push_cpu_ratio"):
        if any(name in r for r in sections):
            results[name] = round(min(r[name] for r in sections if name in r), 3)
    planes = {results[label].get("messenger_data_plane") for label in ("block128", "block16")} - {None}
    if planes:
        results["messenger_data_plane"] = ",".join(sorted(planes))  # the plane the headline Messenger keys measured
    for name, figure in (("transfer_engine_gbps", "messenger_fetch_gbps"),  # the Messenger, its default plane
                         ("grpc_plane_fetch_gbps", "grpc_plane_fetch_gbps"),
                         ("grpc_plane_push_gbps", "grpc_plane_push_gbps"),
                         ("jax_plane_fetch_gbps", "jax_plane_fetch_gbps"),
                         ("jax_plane_push_gbps", "jax_plane_push_gbps"),
                         ("socket_plane_fetch_gbps", "socket_plane_fetch_gbps"),
                         ("socket_plane_push_gbps", "socket_plane_push_gbps")):
        if figure in results["block128"]:
            results[name] = results["block128"][figure]["median"]
    results["layerwise_speedup"] = results.get("layerwise_prefill", {}).get("layerwise_speedup")
    results["block_keys_ms_per_1k_tokens"] = results["block_keys"]["ms_per_1k_tokens_block16"]
    results["goals"] = {"dram_put_ratio": 0.6, "dram_get_ratio": 0.6, "ssd_put_ratio": 0.7, "ssd_get_ratio": 0.7,
                        "messenger_ratio": 0.85, "messenger_push_ratio": 0.85}
    results["load_average_end"] = os.getloadavg()
    results["seconds"] = round(time.perf_counter() - started, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a quarter of the data (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    layerwise = parser.add_mutually_exclusive_group()
    layerwise.add_argument("--skip-layerwise", action="store_true", help="leave out the layer-wise prefill section")
    layerwise.add_argument("--full-layerwise", action="store_true", help="layer-wise prefill on 1K-16K tokens")
    parser.add_argument("--tiers-only", action="store_true",
                        help="only the DRAM and SSD sections (no Messenger, no layer-wise prefill)")
    parser.add_argument("--only", choices=("dram", "ssd", "messenger"), help="that section alone (no layer-wise)")
    parser.add_argument("--dir", type=Path, default=None, help="directory for SSD-tier files (default: a temp dir)")
    args = parser.parse_args()
    mode = "skip" if args.skip_layerwise or args.only else "full" if args.full_layerwise else "default"
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        results = run(args.quick, args.repeats, Path(scratch), layerwise=mode, tiers_only=args.tiers_only,
                      only=args.only)
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    for label in ("block128", "block16", "llama70b_block512"):
        section = results[label]
        medians = {k: round(v["median"], 2) for k, v in section.items() if isinstance(v, dict) and "median" in v}
        print(label, section["spec"], medians, {k: round(v, 3) for k, v in section["ratios"].items()})
    print({k: v for k, v in results.items() if not isinstance(v, dict)})


if __name__ == "__main__":
    main()
