"""The 2,048-token prefill of ``hf_compare.py`` timed for several source trees of mooncake-jax and for Hugging Face
transformers, in alternated rounds: is a slower prefill a regression of the code or the machine and its load?

Two trees cannot be imported in one process (same package name), so each variant is a worker process that loads
the same checkpoint once, compiles and warms its prefill, then waits: the controller tells the workers in turn to
run one prefill and report its wall and process CPU time (all threads). Every variant so sees the same
disturbances, as ``common.interleaved`` does in one process; the controller sleeps 0.2 s between variants so one
engine's worker threads stop spinning before the next runs. Each ``--tree PATH`` worker runs with ``PYTHONPATH=PATH``
and uses only the engine API every tree since the fifth session has (``mj.LLM(folder, prefill_chunk_size=...)``,
``engine.new_sequence / admit / prefill / release``); ``--torch`` adds transformers' forward as ``hf_compare`` times
it (fresh ``DynamicCache``, last position's logits only).

    python benchmarks/prefill_trees_ab.py --tree main=/work/main --tree s5=/tmp/s5 --torch --rounds 7 --json out.json
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, load_average, machine_info, write_json  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048)
"""hf_compare.py's checkpoint (the ``small`` preset's shape)."""


def write_checkpoint(folder: Path, max_pos: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SHAPE, max_position_embeddings=max_pos, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder, safe_serialization=True)


def prompt_of(n: int) -> list[int]:
    return np.random.default_rng(1).integers(0, SHAPE["vocab_size"], n).tolist()


def worker(kind: str, folder: str, n: int) -> None:
    """Load, warm up (two prefills), print "ready", then one timed prefill per "go" line on stdin."""
    prompt = prompt_of(n)
    if kind == "torch":
        import inspect

        import torch
        import transformers

        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        ids = torch.tensor([prompt])

        def run():
            with torch.inference_mode():
                out = hf(input_ids=ids, use_cache=True, logits_to_keep=1,
                         **{cache_kw: transformers.DynamicCache()})
            return out.logits[0, -1].numpy()
    else:
        import mooncake_jax as mj
        from mooncake_jax.model.sequence import SamplingParams

        eng = mj.LLM(folder, prefill_chunk_size=n, max_batch=1, num_pages=n // 16 + 64).engine

        def run():
            seq = eng.new_sequence(prompt, SamplingParams(max_new_tokens=1))
            eng.admit(seq, cached_pages=[])
            out = eng.prefill(seq)
            eng.release(seq)
            return np.asarray(out)
    t = time.perf_counter()
    run()
    first = time.perf_counter() - t
    logits = run()
    print(json.dumps({"ready": True, "first_s": round(first, 2), "logits_head": [float(x) for x in logits[:4]],
                      "module": sys.modules.get("mooncake_jax").__file__ if "mooncake_jax" in sys.modules else None}),
          flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        r0, t, c = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
        run()
        wall, cpu, r1 = time.perf_counter() - t, time.process_time() - c, resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"wall": wall, "cpu": cpu, "sys": r1.ru_stime - r0.ru_stime,
                          "minflt": r1.ru_minflt - r0.ru_minflt}), flush=True)


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a mooncake-jax source tree")
    p.add_argument("--torch", action="store_true", help="also time transformers' prefill")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--worker", default=None, help=argparse_hidden())
    p.add_argument("--folder", default=None, help=argparse_hidden())
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.folder, args.tokens)
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    for name, path in trees.items():
        if not (Path(path) / "mooncake_jax" / "__init__.py").is_file():
            sys.exit(f"--tree {name}={path}: no mooncake_jax package there")
    if not trees and not args.torch:
        sys.exit("nothing to time: give --tree NAME=PATH and/or --torch")
    res = dict(machine_info(), tokens=args.tokens, rounds=args.rounds, trees=trees, load_start=load_average())
    with tempfile.TemporaryDirectory(prefix="prefill_trees_") as tmp:
        write_checkpoint(Path(tmp), max(4096, args.tokens + 64))
        procs = {}
        variants = list(trees) + (["torch"] if args.torch else [])
        for name in variants:  # one at a time: compiles do not overlap
            env = dict(os.environ)
            if name != "torch":
                env["PYTHONPATH"] = trees[name]
            cmd = [sys.executable, __file__, "--worker", "torch" if name == "torch" else "ours", "--folder", tmp,
                   "--tokens", str(args.tokens)]
            procs[name] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ready = json.loads(procs[name].stdout.readline())
            res[f"{name}_first_s"] = ready["first_s"]
            res[f"{name}_logits_head"] = ready["logits_head"]
            res[f"{name}_module"] = ready["module"]
        times = {name: [] for name in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]  # rotate who goes first
            for name in order:
                time.sleep(0.2)
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                times[name].append(json.loads(procs[name].stdout.readline()))
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    res["load_end"] = load_average()
    base = variants[0]
    for name, ts in times.items():
        wall = np.array([t["wall"] for t in ts])
        cpu = np.array([t["cpu"] for t in ts])
        res[f"{name}_wall_ms"] = [round(w * 1e3, 1) for w in wall]
        res[f"{name}_wall_min_ms"] = round(float(wall.min()) * 1e3, 1)
        res[f"{name}_wall_median_ms"] = round(float(np.median(wall)) * 1e3, 1)
        res[f"{name}_cpu_median_ms"] = round(float(np.median(cpu)) * 1e3, 1)
        res[f"{name}_tok_s_best"] = round(args.tokens / float(wall.min()), 1)
        if "sys" in ts[0]:  # kernel time and minor page faults (fresh temp buffers) of one prefill
            res[f"{name}_sys_median_ms"] = round(float(np.median([t["sys"] for t in ts])) * 1e3, 1)
            res[f"{name}_minflt_median"] = int(np.median([t["minflt"] for t in ts]))
    for name in variants[1:]:
        res[f"{name}_over_{base}_wall_min"] = round(res[f"{name}_wall_min_ms"] / res[f"{base}_wall_min_ms"], 3)
        res[f"{name}_over_{base}_wall_median"] = round(res[f"{name}_wall_median_ms"] / res[f"{base}_wall_median_ms"], 3)
        res[f"{name}_over_{base}_cpu_median"] = round(res[f"{name}_cpu_median_ms"] / res[f"{base}_cpu_median_ms"], 3)
    write_json(res, args.json)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
