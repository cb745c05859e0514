"""Cold warm-up: how many programs each engine's warm-up compiles and how long it takes, with an empty compile cache.

A serving instance compiles every step shape before it registers (``Engine.warmup``; a layer-wise prefill instance
also ``warm_layerwise``), so its cold start is that time. Each case runs in its own process with
``XDG_CACHE_HOME`` pointed at a fresh temporary folder and the persistent compile cache enabled there (as an
instance does), so every program is a real compile. Reported per case: the programs warm-up says it compiled
(its return value), the backend compiles JAX reported meanwhile (``/jax/core/compile/backend_compile_duration``
events: the real count, including helpers), the wall time, and the load average before and after.

The physical yardstick measured in the same run: the compile time of one fixed reference program (a chain of
dense layers, compiled in its own fresh process too), so ``<case>_s_over_probe`` compares runs taken at different
loads.

Cases (the engines the instances and ``mj.LLM`` build): ``prefill-tiny`` and ``prefill-small`` (an instance's
prefill engine: chunks of 512, chunk buckets x4, ``warmup(prefill=True, decode=False)``), ``decode-tiny``
(``warmup(prefill=False, decode=True)``, max batch 32), ``layerwise-tiny`` (a layer-wise prefill instance: the
prefill warm-up and ``warm_layerwise``), ``llm-tiny`` (``mj.LLM("tiny").engine.warmup()``: both kinds, chunk
buckets x2).

    python benchmarks/warmup.py --cases prefill-tiny,decode-tiny,layerwise-tiny,llm-tiny --json out.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402

CASES = ("prefill-tiny", "decode-tiny", "layerwise-tiny", "llm-tiny", "prefill-small")


def _loadavg() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def _probe() -> dict:
    """Compile time of a fixed program (12 dense layers with a nonlinearity, 256 wide): the yardstick."""
    import jax
    import jax.numpy as jnp

    def f(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w) + x
        return x.sum()

    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 12
    t = time.perf_counter()
    jax.jit(f).lower(x, ws).compile()
    return {"programs": 1, "compiles": 1, "s": time.perf_counter() - t}


def _case(name: str) -> dict:
    """Run one case in this (fresh) process; returns programs, compiles, seconds."""
    import jax

    from mooncake_jax.model.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # under the fresh XDG_CACHE_HOME: empty
    if name == "probe":
        return _probe()
    import mooncake_jax as mj
    from mooncake_jax.llm import init_model
    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.engine import Engine

    count = {"n": 0}

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            count["n"] += 1

    kind, model = name.split("-")
    if kind == "llm":
        engine = mj.LLM(model).engine
    else:
        engine = Engine(init_model(get_config(model), 0), max_batch=32, prefill_chunk_size=512, bucket_factor=4)
    jax.monitoring.register_event_duration_secs_listener(listener)
    t = time.perf_counter()
    if kind == "decode":
        programs = engine.warmup(prefill=False, decode=True)
    elif kind == "llm":
        programs = engine.warmup()
    else:
        programs = engine.warmup(prefill=True, decode=False)
        if kind == "layerwise":
            from mooncake_jax.transfer.layerwise_warmup import warm_layerwise

            programs += warm_layerwise(engine)
    seconds = time.perf_counter() - t
    jax.monitoring.unregister_event_duration_listener(listener)
    return {"programs": programs, "compiles": count["n"], "s": seconds}


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--cases", default=",".join(CASES[:4]), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--case", help="run one case in this process and print its JSON (internal)")
    args = p.parse_args()
    if args.case:
        print(json.dumps(_case(args.case)))
        return
    names = [c for c in args.cases.split(",") if c]
    for c in names:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; allowed: {', '.join(CASES)}")
    import mooncake_jax

    res = dict(machine_info(), tree=str(Path(mooncake_jax.__file__).parent.parent))
    for name in ["probe"] + names:
        with tempfile.TemporaryDirectory(prefix="warmup-cache-") as cache:
            env = dict(os.environ, XDG_CACHE_HOME=cache)
            load0 = _loadavg()
            out = subprocess.run([sys.executable, __file__, "--case", name], env=env, capture_output=True,
                                 text=True)
            if out.returncode:
                raise SystemExit(f"case {name} failed:\n{out.stderr[-4000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
        key = name.replace("-", "_")
        res[f"{key}_programs"], res[f"{key}_compiles"] = r["programs"], r["compiles"]
        res[f"{key}_s"] = round(r["s"], 2)
        res[f"{key}_load"] = [load0, _loadavg()]
        if name != "probe":
            res[f"{key}_s_over_probe"] = round(r["s"] / res["probe_s"], 1)
        print(f"{name}: {r['programs']} programs, {r['compiles']} compiles, {r['s']:.1f} s "
              f"(load {load0:.1f} -> {_loadavg():.1f})", flush=True)
    write_json(res, args.json)


if __name__ == "__main__":
    main()
