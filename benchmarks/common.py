"""Shared pieces of the benchmark scripts: physical limits measured in the same run, timing, JSON output.

Every figure a benchmark reports is set beside a limit of this machine measured in the same process (matmul peak,
memcpy bandwidth, raw file write, bare gRPC stream), so the ratio means something on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def best_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Fastest wall time of ``fn()`` over ``repeats`` runs (the least disturbed by other load)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def load_average() -> str:
    """The one-minute load average (noted beside timings on a shared machine; "n/a" where /proc is not there)."""
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "n/a"


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, calls: int = 1,
                base: str | None = None, pause_s: float = 0.0) -> dict:
    """Time each of ``variants`` (name -> a call that finishes its work) ``calls`` times per round, the variants in
    turn, for ``rounds`` rounds: on a shared machine a figure taken by one process moves +-10% from run to run, and
    interleaving leaves every variant the same disturbances. Per variant: wall min / p25 / median and process CPU
    time (all threads) median, in ms; per variant but ``base`` (default the first): its CPU median, wall min and
    wall median over ``base``'s (``{name}_cpu_ratio``, ``{name}_wall_min_ratio``, ``{name}_wall_median_ratio``);
    the load average before and after. ``pause_s``: a sleep before each call (a long call's variants then start
    alike, not one straight after another's burst)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    res: dict = {"load_start": load_average()}
    for _ in range(rounds):
        for name, run in variants.items():
            for _ in range(calls):
                if pause_s:
                    time.sleep(pause_s)
                t, c = time.perf_counter(), time.process_time()
                run()
                times[name].append((time.perf_counter() - t, time.process_time() - c))
    res["load_end"] = load_average()
    for name, ts in times.items():
        wall, cpu = np.array([w for w, _ in ts]) * 1e3, np.array([c for _, c in ts]) * 1e3
        res[f"{name}_wall_min_ms"] = round(float(wall.min()), 2)
        res[f"{name}_wall_p25_ms"] = round(float(np.percentile(wall, 25)), 2)
        res[f"{name}_wall_median_ms"] = round(float(np.median(wall)), 2)
        res[f"{name}_cpu_median_ms"] = round(float(np.median(cpu)), 2)
    base = base or next(iter(variants))
    for name in times:
        if name != base:
            for figure, key in (("cpu", "cpu_median"), ("wall_min", "wall_min"), ("wall_median", "wall_median")):
                res[f"{name}_{figure}_ratio"] = round(res[f"{name}_{key}_ms"] / res[f"{base}_{key}_ms"], 3)
    return res


def interleaved_programs(stage, compiled: dict, call_args, rounds: int, pause_s: float = 0.0) -> dict:
    """``interleaved`` over compiled forms (name -> compiled program) of one pipeline stage's ``forward_step``
    called with ``call_args`` (its KV donated from one call to the next, so the stage's own copy is dropped first),
    after one warm-up call of each whose output is compared with the first's (``{name}_logits_max_abs_diff``)."""
    state = {"kv": stage.kv}
    stage.kv = None  # donated by every call: the engine's copy is not used again

    def runner(name):
        def run():
            _, out, state["kv"] = compiled[name](stage.params, state["kv"], *call_args)
            return np.asarray(out)
        return run

    res, ref = {}, None
    for name in compiled:
        out = runner(name)()
        ref = out if ref is None else ref
        res[f"{name}_logits_max_abs_diff"] = float(np.abs(out - ref).max())
    res.update(interleaved({name: runner(name) for name in compiled}, rounds, pause_s=pause_s))
    return res


def alternated_processes(child: str, modes: tuple[str, ...], rounds: int, argv: list[str]) -> dict:
    """Run the script ``child`` (``python -c``) once per mode, the modes in turn, for ``rounds`` rounds, each in a
    fresh process (settings that must precede JAX's threads, such as the malloc arena, cannot be undone in one):
    ``sys.argv[1]`` is the mode, then ``argv``, then this folder (so that the child can import ``common``). Its last
    line of output is JSON, kept as ``{mode}_{round}``; the load average after, as ``load_end``. A child that fails
    ends the benchmark with its error."""
    res = {}
    for r in range(rounds):
        for mode in modes:
            out = subprocess.run([sys.executable, "-c", child, mode, *argv, str(Path(__file__).parent)],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            res[f"{mode}_{r}"] = json.loads(out.stdout.strip().splitlines()[-1])
    res["load_end"] = load_average()
    return res


def matmul_peak_gflops(n: int = 2048, dtype="float32", repeats: int = 10) -> float:
    """Measured dense matmul rate of the default JAX device (GFLOP/s), square n x n x n, of random data (a GPU
    multiplies constant data faster: less switching power, higher clocks)."""
    import jax

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    dt = best_time(lambda: f(a, a).block_until_ready(), repeats=repeats)
    return 2 * n**3 / dt / 1e9


def memcpy_gbps(nbytes: int = 512 * 1024 * 1024, repeats: int = 5) -> float:
    """Host memcpy bandwidth (GB/s of bytes copied) with numpy on one large buffer.

    Both buffers start at a page boundary: where glibc serves large blocks from its heap (the engine's allocator
    settings, ``model/host_memory.py``, applied when an ``Engine`` is built on CPU) two arrays may lie a few bytes
    apart modulo a page, and the copy's loads then alias its stores (4.7 against 18.4 GB/s measured on the AMD
    EPYC), a cost of that placement, not the limit this stands for."""
    from mooncake_jax.transfer.pool import page_aligned_empty

    src = page_aligned_empty((nbytes // 8,), np.float64)
    src[:] = 1.0
    dst = page_aligned_empty((nbytes // 8,), np.float64)
    dt = best_time(lambda: np.copyto(dst, src), repeats=repeats)
    return nbytes / dt / 1e9


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import jax

    return {"machine": platform.machine(), "cpus": os.cpu_count(), "cpu_model": cpu_model(), "jax": jax.__version__,
            "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}


def arg_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--json", type=Path, default=None, help="write the results as a flat JSON object here")
    return p


def decode_ab_parser(doc: str) -> argparse.ArgumentParser:
    """``arg_parser`` with what every whole-decode-step A/B takes: the preset, the batch, the cached tokens per
    sequence and the timed steps per variant (``decode_ab.py``, ``decode_tail_ab.py``, ``decode_step_ab.py``,
    ``decode_dense_ab.py``)."""
    p = arg_parser(doc)
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=16, help="timed steps per variant")
    return p


def prefilled_engine(model: str, batch: int, context: int, max_new_tokens: int, prompts: list | None = None,
                     extra_pages: int = 0):
    """An ``mj.LLM`` sized for ``batch`` sequences of ``context`` prompt tokens and their decode, with those sequences
    admitted and prefilled, for the decode A/B scripts: (llm, sequences, prompts). ``prompts``: the ones to prefill
    (None: drawn from the model's vocabulary with a fixed seed; returned, so a second engine gets the same).
    ``extra_pages``: pages beyond the sizing, so engines built in one process differ in page count and each compiles
    programs of its own."""
    import mooncake_jax as mj

    llm = mj.LLM(model, prefill_chunk_size=512, max_batch=batch,
                 num_pages=1 + batch * (context // 16 + 8) + 64 + extra_pages)
    eng = llm.engine
    if prompts is None:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, llm.config.vocab_size, context).tolist() for _ in range(batch)]
    return llm, prefilled_sequences(eng, prompts, max_new_tokens), prompts


def swapped_decode_steps(args, module, attr: str, variants: dict) -> dict:
    """For the decode A/B scripts: one engine per variant (``name -> value``), each built and its decode program
    compiled while ``module.attr`` is that value (restored after), all prefilled with the same prompts; returns
    ``name -> (one decode step of that engine's batch, its first step's tokens)``."""
    import functools

    prompts, saved, steps = None, getattr(module, attr), {}
    for extra, (name, value) in enumerate(variants.items()):
        setattr(module, attr, value)
        try:
            llm, seqs, prompts = prefilled_engine(args.model, args.batch, args.context, args.steps + 4, prompts, extra)
            first = llm.engine.decode(seqs)  # compiles this engine's decode program with this variant
        finally:
            setattr(module, attr, saved)
        steps[name] = (functools.partial(llm.engine.decode, seqs), first)
    return steps


def prefilled_sequences(engine, prompts: list, max_new_tokens: int) -> list:
    """A sequence per prompt, admitted with no prefix-cache hit and prefilled, ready to decode ``max_new_tokens``
    (end of sequence ignored): the batch a decode measurement steps."""
    from mooncake_jax.model.sequence import SamplingParams

    seqs = []
    for prompt in prompts:
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        engine.admit(seq, cached_pages=[])
        engine.prefill(seq)
        seqs.append(seq)
    return seqs


def chunk_attention(q, k, v, scale: float, impl: str = "auto"):
    """The library's attention (``paged_attention``) of one sequence's chunk of new tokens, no context, called as
    the model calls it: the chunk's K/V written into pages 1.. first, where the cpu_kernel and pallas
    implementations read them. q [1, T, H, G, D], k and v [1, T, H, D]; traced inside the caller's jit."""
    import jax.numpy as jnp

    from mooncake_jax.model import attention as at

    t, hk, d = k.shape[1], k.shape[2], k.shape[3]
    bs = 16
    slots = (bs + jnp.arange(t, dtype=jnp.int32))[None]
    empty = jnp.zeros((hk, 1 + -(-t // bs), bs, d), k.dtype)
    k_pages, v_pages = at.write_pages(empty, k, slots), at.write_pages(empty, v, slots)
    batch = at.PagedBatch(jnp.zeros((1, 0), jnp.int32), jnp.zeros((1,), jnp.int32), slots)
    return at.paged_attention(q, k, v, k_pages, v_pages, batch, scale, impl=impl)


def write_json(results: dict, path: Path | None, echo: bool = True) -> None:
    text = json.dumps(results, indent=2, sort_keys=True)
    if echo:
        print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


DONE = "[DONE]"


def trace_events(folder) -> list[dict]:
    """The events of the newest perfetto trace ``jax.profiler.trace(folder, create_perfetto_trace=True)`` wrote
    under ``folder`` (its ``X`` events are XLA's ops, named by their HLO instruction)."""
    newest = sorted(glob.glob(f"{folder}/**/*perfetto_trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(newest))
    return events["traceEvents"] if isinstance(events, dict) else events


def top_ops_ms(folder, steps: int, n: int = 40) -> dict[str, float]:
    """Milliseconds per step of the ``n`` costliest op names (``X`` events: XLA's ops on CPU, kernels and host
    calls on GPU; not the Python tracer's ``$file:line function`` ones) in the newest trace under ``folder`` of
    ``steps`` steps."""
    per_op = collections.Counter()
    for e in trace_events(folder):
        if e.get("ph") == "X" and not e["name"].startswith("$"):
            per_op[e["name"]] += e.get("dur", 0) / steps / 1e3
    return {k: round(v, 3) for k, v in per_op.most_common(n)}


def sse_payloads(lines):
    """The ``data:`` payloads of a streamed completion as they arrive (``lines``: the response, read line by line):
    each chunk parsed from JSON, and ``DONE`` for the stream's last line."""
    for raw in lines:
        line = raw.strip()
        if line == b"data: [DONE]":
            yield DONE
        elif line.startswith(b"data: "):
            yield json.loads(line[6:])


def start_serve(extra: list[str], timeout_s: float = 900.0, stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, int]:
    """``mooncake-jax serve --model tiny *extra`` as a child; (process, HTTP port) once it prints READY."""
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_jax.cli", "serve", "--model", "tiny", *extra],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    line: dict = {}
    reader = threading.Thread(target=lambda: line.update(text=proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not line.get("text", "").startswith("READY"):
        proc.kill()
        raise RuntimeError(f"serve did not become ready: {line}")
    ports = dict(part.split("=") for part in line["text"].split()[1:])
    return proc, int(ports["http"])
