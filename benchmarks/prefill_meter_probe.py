"""Is a prefill instance's slowdown meter (``instance/prefill.py`` ``SlowdownMeter``) the real served slowdown, or a
bias of the cost model it divides by?

Builds the engine a demo prefill instance serves with (tiny, default ``InstanceConfig``), compiles it and
calibrates it as the instance does at start-up (``calibrate.py``, at this process's priority, nothing else of
ours running), then runs the demo's first N trace prompts through the served prefill path in order (the engine's
own prefix cache reused, the prompt's new blocks read out for the pool: what ``PrefillService._prefill_job``
does) and feeds a ``SlowdownMeter`` the measured over the predicted seconds, as the instance does. Modes:

- ``--niceness 0`` and nothing else: the bias alone (cost model against the served path, same priority, quiet);
- ``--niceness 5 --busy-decode``: served at the demo's prefill priority beside a decode process stepping a batch
  without pause at niceness 0 (the demo's decode instance, busier);
- ``--rival-prefill``: also a second prefill process at the same niceness prefilling without pause (the demo's
  other prefill instance in a burst).

    PYTHONPATH=. python benchmarks/prefill_meter_probe.py --json F [--niceness 5 --busy-decode --rival-prefill]

Writes ``slowdown`` (the meter's weighted median), ``ratio_p50`` / ``ratio_by_tokens`` and the calibration's
points. Used for the eleventh pass of docs/benchmarks/demo.md.
"""

import argparse
import json
import multiprocessing
import os
import time

import numpy as np


def _lower(niceness: int) -> None:
    if niceness:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + niceness)


def _engine(role: str):
    from mooncake_jax.model.compile_cache import enable_compilation_cache
    from mooncake_jax.instance.config import InstanceConfig
    from mooncake_jax.instance.server import build_engine
    from mooncake_jax.llm import build_model

    enable_compilation_cache(None)  # the programs the demo's instances compiled (a cold start takes ~10 min)
    config = InstanceConfig(model="tiny", role=role)
    return build_engine(config, build_model("tiny", seed=0))


def _busy_decode(ready, stop) -> None:
    """A decode instance's engine stepping a batch of two 500-token sequences until ``stop``."""
    from mooncake_jax.model.sequence import SamplingParams

    engine = _engine("decode")
    rng = np.random.default_rng(1)

    def two_sequences() -> list:
        seqs = []
        for _ in range(2):
            seq = engine.new_sequence(rng.integers(0, engine.cfg.vocab_size, 500).tolist(),
                                      SamplingParams(max_new_tokens=3000, ignore_eos=True))
            engine.admit(seq, cached_pages=[])
            engine.prefill(seq)
            seqs.append(seq)
        return seqs

    seqs = two_sequences()
    engine.decode(seqs)
    ready.set()
    n, t = 0, time.perf_counter()
    while not stop.is_set():
        engine.decode(seqs)
        n += 1
        if seqs[0].num_tokens > 3400:  # start over before the pages run out
            for seq in seqs:
                engine.release(seq)
            seqs = two_sequences()
    print(f"busy decode: {n} steps, {(time.perf_counter() - t) / max(n, 1) * 1e3:.2f} ms a step", flush=True)


def _rival_prefill(niceness: int, ready, stop) -> None:
    """Another prefill engine at ``niceness`` prefilling 512-token prompts until ``stop``."""
    from mooncake_jax.model.measure import prefill_seconds

    engine = _engine("prefill")
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, engine.cfg.vocab_size, 512).tolist()
    prefill_seconds(engine, prompt)
    _lower(niceness)
    ready.set()
    while not stop.is_set():
        prefill_seconds(engine, rng.integers(0, engine.cfg.vocab_size, 512).tolist())


def served_prefill(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds of ``prompt`` through a prefill instance's plain served path, and its cached tokens."""
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.transfer.offload import request_keys

    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
    keys = request_keys(seq, engine.block_size)
    usable = keys[: (len(prompt) - 1) // engine.block_size]
    start = len(engine.kv.cached_pages(usable))
    t = time.perf_counter()
    try:
        pages = engine.cached_pages(keys[:start])
        engine.admit(seq, cached_pages=pages)
        engine.prefill(seq)
        engine.read_blocks(seq.pages[start:])
        return time.perf_counter() - t, start * engine.block_size
    finally:
        engine.release(seq)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--niceness", type=int, default=0)
    p.add_argument("--busy-decode", action="store_true")
    p.add_argument("--rival-prefill", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from mooncake_jax import demo
    from mooncake_jax.conductor.accounting import prefill_work_s
    from mooncake_jax.conductor.profile import costs_from_profile
    from mooncake_jax.instance.calibrate import calibrate
    from mooncake_jax.instance.prefill import SlowdownMeter
    from mooncake_jax.model.config import PRESETS

    cfg = PRESETS["tiny"]
    items = demo.workload(args.requests, cfg.vocab_size, cfg.max_seq_len)
    engine = _engine("prefill")
    t = time.perf_counter()
    engine.warmup(prefill=True, decode=False)
    warm_s = time.perf_counter() - t
    profile = json.loads(calibrate(engine, "probe", "tiny", engine.num_pages * engine.block_size))
    costs = costs_from_profile(profile)
    ctx = multiprocessing.get_context("spawn")
    stop, helpers = ctx.Event(), []
    for wanted, target, extra in ((args.busy_decode, _busy_decode, ()),
                                  (args.rival_prefill, _rival_prefill, (args.niceness,))):
        if wanted:
            ready = ctx.Event()
            proc = ctx.Process(target=target, args=(*extra, ready, stop), daemon=True)
            proc.start()
            helpers.append(proc)
            if not ready.wait(900):
                raise SystemExit("a helper process did not start")
    _lower(args.niceness)  # as the cluster lowers a prefill instance once it is ready
    meter = SlowdownMeter(window_s=1e9, samples=1000)
    rows = []
    load = [os.getloadavg()[0]]
    for item in items:
        measured, cached = served_prefill(engine, item["prompt"])
        predicted = prefill_work_s(costs.prefill, len(item["prompt"]), cached)
        meter.record(measured, predicted)
        rows.append({"tokens": len(item["prompt"]), "cached": cached, "measured_s": round(measured, 5),
                     "predicted_s": round(predicted, 5), "ratio": round(measured / predicted, 3)})
    load.append(os.getloadavg()[0])
    stop.set()
    for proc in helpers:
        proc.join(30)
    ratios = np.array([r["ratio"] for r in rows])
    bands = {}
    for lo, hi in ((0, 128), (128, 512), (512, 1024), (1024, 2048), (2048, 8192)):
        sel = [r["ratio"] for r in rows if lo <= r["tokens"] - r["cached"] < hi]
        if sel:
            bands[f"{lo}-{hi}"] = {"n": len(sel), "ratio_p50": round(float(np.median(sel)), 3)}
    out = {"niceness": args.niceness, "busy_decode": args.busy_decode, "rival_prefill": args.rival_prefill,
           "slowdown": round(meter.slowdown(), 3), "ratio_p50": round(float(np.median(ratios)), 3),
           "ratio_by_new_tokens": bands, "warmup_s": round(warm_s, 1), "load_start_end": load,
           "calibration_points": profile["prefill"]["points"], "fit": profile["prefill"]["use"], "prefills": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "prefills"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
