"""How late the gateway's HTTP front end delivers each streamed token: a backend that yields tokens on a fixed
schedule, the real ``GatewayServer`` in this process (tuned as a serving gateway is: ``settle_serving_process``),
and streaming clients in a separate process, as the demo's are.

    python benchmarks/gateway_stream.py --json /tmp/gateway_stream.json [--streams 4] [--busy 2]

The backend yields token ``i`` of a stream at ``start + i * --gap-ms`` (sleeping until then, so a late token does
not shift the ones after it). A client stamps each server-sent chunk on arrival; a token's lateness is its arrival
minus ``i`` gaps, less the smallest such figure of its stream (its least delayed token), so it is the delivery
jitter the gateway adds. ``--busy K`` starts K processes spinning in
Python at the default priority, the other work a 2-core host runs beside the demo's gateway (the prefill and
decode instances). Figures: the client's token gaps and the lateness (ms, p50 / p90 / p99 / max), and the
gateway process's CPU time per token.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, cpu_model, load_average, write_json  # noqa: E402

from mooncake_jax.gateway import GatewayServer  # noqa: E402
from mooncake_jax.gateway.backend import FINISH_LENGTH, Finished, TokenOut, paper_tbt  # noqa: E402
from mooncake_jax.instance.main import settle_serving_process  # noqa: E402


class PacedBackend:
    """Yields ``max_tokens`` tokens ``gap_s`` apart on a fixed schedule (token ids cycle through 3..259)."""

    model_name = "paced"
    vocab_size = 512
    max_context = 4096
    eos_token_id = 2

    def __init__(self, gap_s: float):
        self.gap_s = gap_s

    def generate(self, request, cancelled=None):
        start = time.perf_counter()
        times = []
        for i in range(request.max_tokens):
            delay = start + i * self.gap_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if cancelled is not None and cancelled.is_set():
                break
            times.append(time.perf_counter() - start)
            yield TokenOut(3 + i % 256, i, times[-1])
        yield Finished(FINISH_LENGTH, len(request.prompt), len(times), 0, times[0] if times else 0.0,
                       paper_tbt(times))

    def health(self):
        return None

    def stats(self):
        return {}


def stream_arrivals(url: str, tokens: int) -> list[float]:
    """One streaming completion of ``tokens`` tokens: each token's arrival (``perf_counter``)."""
    body = json.dumps({"model": "paced", "prompt": [1, 5, 6], "max_tokens": tokens, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    arrivals = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            if raw.startswith(b"data: {") and b'"token_ids": [' in raw and b'"token_ids": []' not in raw:
                arrivals.append(time.perf_counter())
    return arrivals


def clients(url: str, streams: int, requests: int, tokens: int) -> list[list[float]]:
    """The client process: ``requests`` streams, ``streams`` at a time."""
    with ThreadPoolExecutor(streams) as pool:
        return list(pool.map(lambda _: stream_arrivals(url, tokens), range(requests)))


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(1000))


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--streams", type=int, default=4, help="concurrent streams")
    p.add_argument("--requests", type=int, default=24, help="streams in all")
    p.add_argument("--tokens", type=int, default=150, help="tokens per stream")
    p.add_argument("--gap-ms", type=float, default=1.7, help="the backend's token gap (the demo's decode step)")
    p.add_argument("--busy", type=int, default=0, help="processes spinning beside the gateway")
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    busy = [ctx.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    load_before = load_average()
    with GatewayServer(PacedBackend(args.gap_ms / 1e3), grpc_port=None) as gateway:
        settle_serving_process(carries_tokens=True)
        url = f"http://127.0.0.1:{gateway.http_port}/v1/completions"
        stream_arrivals(url, 8)  # the first request's imports and JIT-free warm-up
        for b in busy:
            b.start()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with ctx.Pool(1) as pool:
            runs = pool.apply(clients, (url, args.streams, args.requests, args.tokens))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        stop.set()
        for b in busy:
            b.join(5)
    gap_s = args.gap_ms / 1e3
    gaps = np.concatenate([np.diff(a) for a in runs]) * 1e3
    lates = [(np.asarray(a) - gap_s * np.arange(len(a))) * 1e3 for a in runs]
    lates = [x - x.min() for x in lates]  # each stream against its own earliest token
    late = np.concatenate(lates)
    worst = sorted(float(x.max()) for x in lates)[-3:]
    count = sum(len(a) for a in runs)

    def pct(x):
        return {f"p{q}": round(float(np.percentile(x, q)), 3) for q in (50, 90, 99)} | {"max": round(float(x.max()), 3)}

    results = {"cpu_model": cpu_model(), "load_before": load_before, "load_after": load_average(),
               "streams": args.streams, "requests": args.requests, "tokens_per_stream": args.tokens,
               "gap_ms": args.gap_ms, "busy": args.busy, "tokens": count,
               "gap_ms_pct": pct(gaps), "lateness_ms_pct": pct(late),
               "lateness_p99_ms": round(float(np.percentile(late, 99)), 3),
               "gap_p99_ms": round(float(np.percentile(gaps, 99)), 3),
               "worst_streams_lateness_ms": [round(w, 1) for w in worst],
               "gateway_cpu_us_per_token": round(cpu / count * 1e6, 1), "wall_s": round(wall, 2)}
    print(json.dumps({k: results[k] for k in ("load_before", "gap_ms_pct", "lateness_ms_pct", "gateway_cpu_us_per_token")}))
    write_json(results, args.json)


if __name__ == "__main__":
    main()
