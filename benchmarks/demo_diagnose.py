"""Why does the demo refuse requests? Starts the demo's cluster (``--hetero``: the unlike instances), runs the
serving-path warm-up and replays the first N trace requests in this process, printing each prefill instance's
slowdown, queue and refusal counters before and after the warm-up and every 2 s of the replay, then each request's
outcome with its refusal message (the Conductor's reason, or the prefill instance's "N s of work, M s left").

    PYTHONPATH=. python benchmarks/demo_diagnose.py --hetero --requests 20

Used for demo --hetero's ninth and tenth passes (docs/benchmarks/demo.md).
"""

import argparse
import json
import logging
import tempfile
import threading
import time

from mooncake_jax import demo
from mooncake_jax.conductor.accounting import prefill_work_s
from mooncake_jax.conductor.profile import costs_from_profile
from mooncake_jax.instance.cluster import Cluster
from mooncake_jax.instance.main import settle_serving_process
from mooncake_jax.model.config import PRESETS

WORDS = ("slowdown", "queued", "predicted_queue", "refused", "rejected", "prefill_requests", "decode_step")


def keyed(stats: dict) -> dict:
    return {k: round(v, 3) for k, v in stats.items() if any(w in k for w in WORDS)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--hetero", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = PRESETS["tiny"]
    items = demo.workload(args.requests, cfg.vocab_size, cfg.max_seq_len)
    log_dir = tempfile.mkdtemp(prefix="demo-diagnose-")
    t0 = time.time()
    cluster = Cluster.local("tiny", prefill=2, decode=1, processes=True, admission="predictive", ttft_slo_s=2.0,
                            tbt_slo_s=0.25, log_dir=log_dir, **(demo.HETERO if args.hetero else {}))
    print(f"started in {time.time() - t0:.1f} s (logs in {log_dir})", flush=True)
    for name, inst in cluster.instances.items():  # what each registered: its cost model's prefill at a few lengths
        costs = costs_from_profile(inst.info["profile_json"])
        print(name, "profile prefill s at 16/64/256/512/724 tokens:",
              [round(prefill_work_s(costs.prefill, n, 0), 4) for n in (16, 64, 256, 512, 724)], flush=True)
    with cluster:
        print("before warm-up", json.dumps(keyed(cluster.stats())), flush=True)
        tw = time.time()
        done = cluster.warm_serving_path()
        print(f"warm-up: {done} completed in {time.time() - tw:.1f} s", flush=True)
        print("after warm-up", json.dumps(keyed(cluster.stats())), flush=True)
        stop = threading.Event()

        def watch():
            while not stop.wait(2.0):
                print(f"t+{time.time() - tw:.0f}s", json.dumps(keyed(cluster.stats())), flush=True)

        threading.Thread(target=watch, daemon=True).start()
        gateway = cluster.serve_gateway(grpc_port=None, http_port=0)
        settle_serving_process()
        results, _ = demo.replay(f"http://127.0.0.1:{gateway.http_port}/v1/completions", items, 1.0)
        stop.set()
        for i, r in enumerate(results):
            outcome = f"TTFT {r['times'][0]:.3f} s" if r.get("times") else r.get("error", "")[:240]
            print(i, f"at {items[i]['at']:.2f} s", f"{len(items[i]['prompt'])} tokens", r["status"], outcome, flush=True)
        print("after replay", json.dumps(keyed(cluster.stats())), flush=True)
        print(demo.refusal_line(demo.refusals(results, items)), flush=True)


if __name__ == "__main__":
    main()
