"""Cold start of a prefill instance: the wall and CPU time of an engine's prefill warm-up with an empty compile
cache, for one or more source trees (e.g. main against a branch), each warm-up in a fresh process.

Each run builds an ``Engine`` of ``--model`` (random weights; ``--max-seq-len`` bounds the context tables the
warm-up enumerates), points the persistent compilation cache at a new empty folder, and times
``engine.warmup(decode=False, blocks=False, prompt_logprobs=False)``: every prefill step shape (chunk buckets x
context-table widths), the programs a prefill instance compiles before taking traffic. Trees are alternated over
``--rounds`` (tree A, B, then B, A ...). The per-program figure (seconds / programs) is the comparable one when
the trees enumerate different shapes.

    python benchmarks/prefill_warmup.py --trees /work/main,. --model tiny --json results/prefill_warmup.json
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


def warm(model: str, chunk: int, bucket_factor: int, max_seq_len: int | None) -> dict:
    """In this process (the tree on PYTHONPATH): one cold prefill warm-up."""
    import mooncake_jax
    from mooncake_jax.model.compile_cache import enable_compilation_cache
    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.engine import Engine
    from mooncake_jax.model.llama import init_model

    with tempfile.TemporaryDirectory() as cache:
        enable_compilation_cache(cache)
        cfg = get_config(model)
        if max_seq_len:
            cfg = cfg.replace(max_seq_len=max_seq_len)
        engine = Engine(init_model(cfg, 0), prefill_chunk_size=chunk, bucket_factor=bucket_factor)
        wall, cpu = time.perf_counter(), time.process_time()
        programs = engine.warmup(decode=False, blocks=False, prompt_logprobs=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"tree": str(Path(mooncake_jax.__file__).parent.parent), "programs": programs, "warmup_s": round(wall, 2),
            "warmup_cpu_s": round(cpu, 2), "s_per_program": round(wall / programs, 3)}


def main() -> None:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--trees", default=None, help="comma-separated source trees, each put on PYTHONPATH in turn")
    p.add_argument("--names", default=None, help="comma-separated names of the trees in the JSON keys")
    p.add_argument("--model", default="tiny")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    p.add_argument("--bucket-factor", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=None, help="override the preset's (fewer context widths)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--run", action="store_true", help="(internal) warm up in this process and print JSON")
    args = p.parse_args()
    if args.run:
        print(json.dumps(warm(args.model, args.chunk, args.bucket_factor, args.max_seq_len)))
        return
    if not args.trees:
        raise ValueError("--trees is required: comma-separated source trees, e.g. /work/main,.")
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    names = args.names.split(",") if args.names else [f"tree{i}" for i in range(len(trees))]
    if len(names) != len(trees):
        raise ValueError(f"--names has {len(names)} names for {len(trees)} trees")
    res = {**machine_info(), "model": args.model, "chunk": args.chunk, "bucket_factor": args.bucket_factor,
           "max_seq_len": args.max_seq_len, "load_avg_1m_start": os.getloadavg()[0]}
    cmd = [sys.executable, __file__, "--run", "--model", args.model, "--chunk", str(args.chunk),
           "--bucket-factor", str(args.bucket_factor)] + (["--max-seq-len", str(args.max_seq_len)]
                                                          if args.max_seq_len else [])
    order = list(zip(names, trees))
    for r in range(args.rounds):
        for name, tree in (order if r % 2 == 0 else order[::-1]):
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            fig = json.loads(out.stdout.strip().splitlines()[-1])
            if fig["tree"] != tree:
                raise RuntimeError(f"imported mooncake_jax from {fig['tree']}, not {tree}")
            for key in ("programs", "warmup_s", "warmup_cpu_s", "s_per_program"):
                res[f"{name}_{key}_{r}"] = fig[key]
            res[f"{name}_tree"] = tree
            print(name, r, fig, os.getloadavg()[0], flush=True)
    for name in names:
        res[f"{name}_warmup_s_min"] = min(res[f"{name}_warmup_s_{r}"] for r in range(args.rounds))
        res[f"{name}_warmup_cpu_s_min"] = min(res[f"{name}_warmup_cpu_s_{r}"] for r in range(args.rounds))
    if len(names) == 2:
        a, b = names
        res[f"warmup_s_ratio_{b}_over_{a}"] = round(res[f"{b}_warmup_s_min"] / res[f"{a}_warmup_s_min"], 3)
        res[f"warmup_cpu_s_ratio_{b}_over_{a}"] = round(res[f"{b}_warmup_cpu_s_min"] / res[f"{a}_warmup_cpu_s_min"], 3)
    res["load_avg_1m_end"] = os.getloadavg()[0]
    write_json(res, args.json)


if __name__ == "__main__":
    main()
