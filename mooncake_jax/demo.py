"""``mooncake-jax demo``: the main job end to end on the embedded default.

Starts the default local cluster (the ``tiny`` model, 2 prefill + 1 decode instance processes, the Conductor and
the gateway), replays the first requests of the bundled conversation trace through the gateway's OpenAI HTTP
endpoint at their recorded arrival times, and prints what a serving operator looks at: completions, rejections,
TTFT and TBT percentiles, SLO attainment, prefix cache hits and KV bytes moved.

Trace lengths are scaled to the tiny model: a trace block of 512 tokens becomes an engine block of 16 tokens
(``scale`` 32), and each block id becomes 16 token ids drawn from a generator seeded by the id, so the trace's
shared prefixes are real shared prefixes in the engine.

``--hetero`` runs the same job on unlike instances under the same Conductor (``HETERO``): layer-wise bfloat16
prefill instances on one device each with 16-token pages, a float32 decode instance with 2-way tensor parallelism
and 32-token pages (the decode side converts the KV it pulls), each on its own fake CPU devices (4 for the default
2 + 1). Its summary adds ``instances``: each instance's role, shape, dtype, block size and devices.

Every refused request's reason is kept (``refusals`` in the summary: the Conductor's, with its predictions, for an
early refusal; the instance's, with its work and the time left, for a late one) and counted in one printed line, so
a stray refusal explains itself.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .slo import tbt_of_times

TRACE_BLOCK, ENGINE_BLOCK = 512, 16

HETERO_PREFILL_PAGES = 513
"""KV pages of a ``--hetero`` prefill instance's engine: two of the tiny model's longest prompts (4,096 tokens, 256
16-token pages each) and the scratch page. A layer-wise prefill instance holds no KV in its engine between requests
(each prompt's prefix is staged from the pool, its pages released after), so this is all it uses. The engine's
default sizes for a decode batch, 8,193 pages. Chosen when a bfloat16 prefill's cost still grew with the cache
(tiny, one fake CPU device, Intel Xeon (207), load 7: a 16-token layer-wise prefill 0.39 s over 8,193 pages, 0.023 s
over 256; float32 over 8,193: 0.016 s), before the cache was stored as 16-bit integers on CPU (``kv_scatter``),
which removed that growth; kept because it is all such an instance uses."""

HETERO = dict(prefill_shape="tensor=1", prefill_dtype="bfloat16", prefill_block_size=ENGINE_BLOCK, layerwise=True,
              prefill_num_pages=HETERO_PREFILL_PAGES,
              decode_shape="tensor=2", decode_dtype="float32", decode_block_size=2 * ENGINE_BLOCK)
"""``demo --hetero``'s per-role shapes (``Cluster.local`` options): unlike in tensor parallelism, dtype and page
size, so every request's KV is re-laid out between its prefill and decode instance. Chosen by measurement on two
shared cores (Intel Xeon (207), tiny, fake CPU devices; docs/benchmarks/demo.md, hetero tenth pass): a 4-way decode
step took 311-447 ms in the ninth pass (the TBT SLO is 0.25 s), a 2-way one a few ms; a bfloat16 layer-wise
prefill of 512 tokens took 35 ms on one device and 77 ms on two, so the prefill, which decides TTFT, runs on one."""


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=100, help="first N requests of the trace")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed (2.0 halves the gaps)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tbt-slo-s", type=float, default=0.25)
    p.add_argument("--admission", default="predictive", choices=["none", "baseline", "early", "predictive"])
    p.add_argument("--in-process", action="store_true",
                   help="instances as threads instead of processes (one process holds every instance's compiled "
                        "programs: with --hetero, use --prefill 1 to stay within Linux's memory-map limit)")
    p.add_argument("--hetero", action="store_true",
                   help="unlike instances: bfloat16 layer-wise prefill on one device each (16-token pages), float32 "
                        "tensor=2 decode (32-token pages), each on its own fake CPU devices")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-cpus", default=None,
                       help=f"host cores of the {role} instances' own, e.g. 1 (the rest keep off them; default: "
                            f"none, every process on every core)")
    from .transfer.messenger import DATA_PLANES  # here, not at import: ``mooncake-jax --help`` stays light

    p.add_argument("--data-plane", default=None, choices=DATA_PLANES,
                   help="how block data moves between instances: auto (default: the socket plane where both ends "
                        "serve it and TLS is off, else gRPC), grpc, jax, socket")
    p.add_argument("--json", type=Path, default=None, help="also write the results table as JSON")
    p.add_argument("--trace", type=Path, default=None,
                   help="also write each request's client-side token times as JSON (diagnostics: its start on the "
                        "host's monotonic clock, time.perf_counter, and each token's time from it)")


def workload(n: int, vocab_size: int, max_context: int) -> list[dict]:
    """The first ``n`` trace requests as token-id prompts for the tiny model (arrival s, prompt, max_tokens)."""
    from .sim.trace import load_trace, synthesize_prompt

    scale = TRACE_BLOCK // ENGINE_BLOCK
    trace = load_trace("conversation", first=n)
    t0 = trace.requests[0].timestamp_s
    out = []
    for r in trace.requests:
        max_tokens = max(1, round(r.output_length / scale))
        prompt = synthesize_prompt(r.hash_ids, r.input_length, ENGINE_BLOCK, vocab_size, scale=scale)
        prompt = prompt[: max_context - max_tokens]
        out.append({"at": r.timestamp_s - t0, "prompt": prompt, "max_tokens": max_tokens,
                    "blocks": tuple(r.hash_ids[: -(-len(prompt) // ENGINE_BLOCK)])})  # the trace's ids of its blocks
    return out


def send(url: str, item: dict, timeout_s: float = 300.0) -> dict:
    """One streaming completion; returns the outcome and the client-side token times."""
    body = json.dumps({"model": "tiny", "prompt": item["prompt"], "max_tokens": item["max_tokens"],
                       "temperature": 0.0, "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times, usage, completion_id = [], {}, None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return {"status": "failed", "error": chunk["error"].get("message", "")}
                completion_id = completion_id or chunk.get("id")
                if chunk.get("choices"):
                    times += [time.perf_counter() - t0] * len(chunk["choices"][0].get("token_ids") or [])
                usage = chunk.get("usage") or usage
    except urllib.error.HTTPError as e:
        error = error_fields(e.read().decode(errors="replace"))
        out = {"status": "rejected" if e.code == 429 else "failed", "code": e.code, "error": error["message"]}
        if e.code == 429:
            out.update(stage=error.get("stage", ""), cause=error.get("cause", ""))
        return out
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        return {"status": "failed", "error": str(e)}
    return {"status": "completed", "times": times, "usage": usage, "prompt_tokens": len(item["prompt"]),
            "id": completion_id, "started": t0}


def error_fields(body: str) -> dict:
    """The ``error`` object of an OpenAI-style error body (``{"error": {"message": ..., ...}}``; a 429's carries
    ``stage`` and ``cause`` too), else ``{"message": <the body's start>}``."""
    try:
        error = json.loads(body)["error"]
        return {**error, "message": str(error["message"])[:1000]}
    except (ValueError, KeyError, TypeError):
        return {"message": body[:1000]}


def refusals(results: list[dict], items: list[dict]) -> list[dict]:
    """Each refused request (a 429) with its reason and the gateway's ``stage`` and ``cause`` for it: early (the
    Conductor refused it before any work, cause its reason, e.g. ``ttft_slo``; the message gives its predictions)
    or late (an instance did after the Conductor had placed it, cause the instance's id; the message gives its
    work and the time left)."""
    return [{"request": i, "at_s": round(items[i]["at"], 3), "prompt_tokens": len(items[i]["prompt"]),
             "stage": r.get("stage", ""), "cause": r.get("cause", ""), "reason": r.get("error", "")}
            for i, r in enumerate(results) if r["status"] == "rejected"]


def refusal_line(refused: list[dict]) -> str:
    """One line counting ``refusals`` by stage and cause, e.g. "refused 3: early 2 (ttft_slo 2), late 1
    (prefill-1 1)"."""
    if not refused:
        return "refused 0"
    parts = []
    order = {"early": 0, "late": 1}
    for stage in sorted({r["stage"] for r in refused}, key=lambda stage: (order.get(stage, 2), stage)):
        causes = collections.Counter(r["cause"] or "unknown" for r in refused if r["stage"] == stage)
        parts.append(f"{stage or 'unknown'} {sum(causes.values())} ("
                     + ", ".join(f"{c} {n}" for c, n in sorted(causes.items())) + ")")
    return f"refused {len(refused)}: " + ", ".join(parts)


_done_counter = None  # the client process's count of finished requests (shared memory; the parent's bar reads it)


def _count_into(counter) -> None:
    """The client process's start: its counter, and the default CPU slice (the gateway's process, which started
    it, asked for short ones; the clients stand for users elsewhere and get no such favour)."""
    global _done_counter
    _done_counter = counter
    from .instance.sched_slice import restore_default_slices

    restore_default_slices()


def replay(url: str, items: list[dict], speed: float, clients: int = 64) -> tuple[list[dict], float]:
    """Send ``items`` at their arrival times (``at / speed`` seconds from now) from ``clients`` threads; the
    outcomes in order, and the seconds it took."""

    results: list = [None] * len(items)
    start = time.perf_counter()

    def one(i: int) -> None:
        delay = items[i]["at"] / speed - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        results[i] = send(url, items[i])
        if _done_counter is not None:
            with _done_counter.get_lock():
                _done_counter.value += 1

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(len(items))))
    return results, time.perf_counter() - start


def replay_in_own_process(url: str, items: list[dict], speed: float, bar) -> tuple[list[dict], float]:
    """``replay`` from a separate process, as real clients are: 64 client threads parsing server-sent events in
    the gateway's own process share its interpreter lock with the gateway that streams the very tokens they time
    (measured, it is not what makes the demo's longest gaps: those stayed). ``bar`` follows the requests done."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # nothing of this process (threads, JAX) is carried over
    counter = ctx.Value("i", 0)
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=_count_into, initargs=(counter,)) as pool:
        future = pool.submit(replay, url, items, speed)
        while not future.done():
            time.sleep(0.2)
            bar.update(counter.value - bar.n)
        results, wall_s = future.result()
    bar.update(len(items) - bar.n)
    return results, wall_s


def client_trace(results: list[dict], items: list[dict]) -> list[dict]:
    """Each request as its client saw it: arrival in the trace, status, the completion's id, when it was sent (the
    client process's ``time.perf_counter``: on Linux the host's monotonic clock, the same in every process) and
    each token's time from then. What ``--trace`` writes, to set a long token gap beside what the servers did."""
    return [{"request": i, "at_s": items[i]["at"], "prompt_tokens": len(items[i]["prompt"]), "status": r["status"],
             "id": r.get("id"), "started": r.get("started"), "times": r.get("times")}
            for i, r in enumerate(results)]


def counters_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after`` less ``before``, key by key (the cluster's ``*_total`` counters: what happened in between; the
    summary reads only counters)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def summarize(results: list[dict], ttft_slo: float, tbt_slo: float, wall_s: float, stats: dict) -> dict:
    done = [r for r in results if r["status"] == "completed" and r["times"]]
    ttft = np.array([r["times"][0] for r in done]) if done else np.zeros(0)
    tbts = np.array([tbt_of_times(r["times"]) for r in done if len(r["times"]) > 1])
    ok = sum(1 for r in done if r["times"][0] <= ttft_slo and tbt_of_times(r["times"]) <= tbt_slo)
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in done)
    # each transfer counted once, at the Messenger server it went through (pushes received, fetches sent)
    moved = sum(v for k, v in stats.items() if k.split("{")[0].endswith(("messenger_bytes_received",
                                                                         "messenger_bytes_sent")))

    def total(name: str) -> float:  # summed over instances (stats keys are ``name{instance="..."}``)
        return sum(v for k, v in stats.items() if k.split("{")[0] == name)

    steps = total("instance_decode_steps_total")
    step_s = total("instance_decode_step_seconds_total") / steps if steps else None

    def pct(a, q):
        return round(float(np.percentile(a, q)), 4) if a.size else None

    return {
        "requests": len(results), "completed": len(done),
        "rejected_early": int(stats.get("cluster_rejected_early_total", 0)),
        "rejected_late": int(stats.get("cluster_rejected_late_total", 0)),
        "failed": sum(1 for r in results if r["status"] == "failed"),
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
        "tbt_p50_s": pct(tbts, 50), "tbt_p90_s": pct(tbts, 90), "tbt_p99_s": pct(tbts, 99),
        "decode_step_s": round(step_s, 4) if step_s else None,
        "decode_batch_mean": round(total("instance_decode_step_rows_total") / steps, 2) if steps else None,
        "tbt_p99_over_step": round(pct(tbts, 99) / step_s, 2) if step_s and tbts.size else None,
        "slo_attainment": round(ok / len(results), 4) if results else None,
        "ttft_slo_s": ttft_slo, "tbt_slo_s": tbt_slo,
        "cache_hit_ratio": round(cached / prompt_tokens, 4) if prompt_tokens else None,
        "transfer_bytes": int(moved), "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(sum(len(r["times"]) for r in done) / wall_s, 1) if wall_s else None,
    }


def slowdowns(stats: dict[str, float]) -> dict[str, float]:
    """Each prefill instance's slowdown meter at the end of the replay (measured over predicted compute of its
    recent prefills, ``instance/prefill.py``): how far its registered cost model was off while serving."""
    out = {}
    for key, value in stats.items():
        name, _, labels = key.partition("{")
        if name.endswith("prefill_slowdown") and 'instance="' in labels:
            out[labels.split('instance="', 1)[1].split('"', 1)[0]] = round(value, 3)
    return dict(sorted(out.items()))


def describe_instances(configs, model_config) -> list[dict]:
    """Each instance's shape as the summary reports it (dtype and block size resolved to the model's own where the
    config leaves them to it)."""
    from .instance.config import format_devices

    return [{"instance_id": c.instance_id, "role": c.role, "shape": c.shape, "tensor_parallel": c.tensor_parallel,
             "pipeline_stages": c.pipeline_stages, "dtype": c.dtype or model_config.dtype,
             "block_size": c.block_size or model_config.block_size, "layerwise": c.layerwise if c.role == "prefill"
             else False, "devices": format_devices(c.devices) or None}
            for c in configs]


def print_table(summary: dict) -> None:
    rows = [("requests", summary["requests"]), ("completed", summary["completed"]),
            ("rejected early / late", f"{summary['rejected_early']} / {summary['rejected_late']}"),
            ("failed", summary["failed"]),
            ("TTFT p50 / p90 / p99 (s)", f"{summary['ttft_p50_s']} / {summary['ttft_p90_s']} / {summary['ttft_p99_s']}"),
            ("TBT p50 / p90 / p99 (s)", f"{summary['tbt_p50_s']} / {summary['tbt_p90_s']} / {summary['tbt_p99_s']}"),
            ("decode step (s) at mean batch; TBT p99 / step",
             f"{summary['decode_step_s']} at {summary['decode_batch_mean']}; {summary['tbt_p99_over_step']}"),
            (f"SLO attainment (TTFT <= {summary['ttft_slo_s']} s, TBT <= {summary['tbt_slo_s']} s)",
             summary["slo_attainment"]),
            ("prefix cache hit ratio (tokens)", summary["cache_hit_ratio"]),
            ("KV bytes moved between instances", f"{summary['transfer_bytes']:,}"),
            ("output tokens / s", summary["output_tokens_per_s"]),
            ("wall time (s)", summary["wall_s"])]
    for inst in summary.get("instances", []):
        rows.append((f"instance {inst['instance_id']}", f"{inst['shape']} {inst['dtype']} block {inst['block_size']}"
                                                        f" devices {inst['devices']}"))
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print()


def run(args) -> int:
    from tqdm import tqdm

    from .instance.cluster import Cluster
    from .instance.main import settle_serving_process
    from .model.config import PRESETS
    from .model.map_budget import MapBudgetExhausted

    if args.requests < 1 or args.speed <= 0:
        print("mooncake-jax demo: --requests must be >= 1 and --speed > 0", file=sys.stderr)
        return 2
    cfg = PRESETS["tiny"]
    items = workload(args.requests, cfg.vocab_size, cfg.max_seq_len)
    shapes = HETERO if getattr(args, "hetero", False) else {}
    print(f"starting the cluster: tiny model, {args.prefill} prefill + {args.decode} decode instances"
          f"{' (unlike: ' + ', '.join(f'{k}={v}' for k, v in shapes.items()) + ')' if shapes else ''} ...",
          flush=True)
    log_dir = tempfile.mkdtemp(prefix="mooncake-demo-")
    try:
        cluster = Cluster.local("tiny", prefill=args.prefill, decode=args.decode, processes=not args.in_process,
                                admission=args.admission, ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_s,
                                log_dir=log_dir, prefill_cpus=args.prefill_cpus,
                                decode_cpus=args.decode_cpus, **shapes,
                                **({} if getattr(args, "data_plane", None) is None else
                                   {"data_plane": args.data_plane}))
    except (ValueError, MapBudgetExhausted) as e:  # a shape the devices or the model cannot take; too many programs
        print(f"mooncake-jax demo: {e}", file=sys.stderr)  # for one process (--in-process): said, not a crash
        return 2
    with cluster:
        cluster.warm_serving_path()
        before = cluster.stats()  # the figures below count the replay only, not the warm-up
        gateway = cluster.serve_gateway(grpc_port=None, http_port=0)
        settle_serving_process(carries_tokens=True)
        url = f"http://127.0.0.1:{gateway.http_port}/v1/completions"
        print(f"replaying {len(items)} trace requests through {url} (instance logs in {log_dir})", flush=True)
        bar = tqdm(total=len(items), desc="requests", unit="req")
        results, wall = replay_in_own_process(url, items, args.speed, bar)  # wall: the replay's, not the spawn's
        bar.close()
        after = cluster.stats()
        summary = summarize(results, args.ttft_slo_s, args.tbt_slo_s, wall, counters_since(before, after))
        summary["prefill_slowdown"] = slowdowns(after)
        if shapes:
            summary["instances"] = describe_instances(cluster.configs, cfg)
        summary["refusals"] = refusals(results, items)
    print_table(summary)
    print(f"  {refusal_line(summary['refusals'])}")
    for r in summary["refusals"][:5]:
        print(f"  refused {r['stage']}: request {r['request']} ({r['prompt_tokens']} tokens at {r['at_s']} s): "
              f"{r['reason']}")
    for r in [r for r in results if r["status"] == "failed"][:5]:
        print(f"  failed: {r.get('code', '')} {r.get('error', '')}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if getattr(args, "trace", None):
        args.trace.write_text(json.dumps(client_trace(results, items)) + "\n")
    return 0 if summary["failed"] == 0 else 1
