"""Prefill step time of a multi-process instance (2 processes x 4 CPU devices, jax.distributed + gloo; ``--tensor``
sets the devices per process) against a single process over the same 8 devices, both running the same SPMD
pipeline program (stage=2, tensor=4), and the single process's per-stage-dispatch pipeline (``PipelineRunner``)
beside them.

The difference between the first two is what spanning processes costs: the step inputs sent from process 0
(``StepChannel``) and the program's collectives through gloo (the stage-to-stage ``ppermute``, the logits' gather)
instead of in-process copies. The physical limit set beside them is this CPU's float32 matmul peak, measured in the
same run (the prefill's 2 x params x tokens FLOPs over its time, as a fraction of that peak). CPU model and load
average are written beside every figure: the machine is shared, and both variants share its cores.

    python benchmarks/multiprocess_prefill.py --json results/multiprocess_prefill.json
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, cpu_model, matmul_peak_gflops, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(a) -> None:
    """One measuring process: ``--worker single`` (8 local devices) or ``--worker PROCESS_ID`` of a 2-process group."""
    import numpy as np

    from mooncake_jax.instance.config import InstanceConfig
    from mooncake_jax.instance.devices import reserve_cpu_devices
    from mooncake_jax.instance.distributed import join_group, run_follower, stop_followers

    spmd = a.worker != "pipeline"
    multi = a.worker not in ("single", "pipeline")
    fields = dict(role="prefill", model=a.model, pipeline_stages=2, tensor_parallel=a.tensor,
                  prefill_chunk_size=a.chunk, max_batch=1, num_pages=1 + 2 * (a.tokens // 16 + 1))
    if multi:
        cfg = InstanceConfig(**fields, coordinator=a.coordinator, num_processes=2, process_id=int(a.worker))
        reserve_cpu_devices(a.tensor)
        join_group(cfg.coordinator, 2, cfg.process_id, cfg.coordinator_timeout_s)
        if cfg.process_id != 0:
            run_follower(cfg)
            return
    else:
        cfg = InstanceConfig(**fields)
        reserve_cpu_devices(2 * a.tensor)
    import jax

    from mooncake_jax.llm import build_model
    from mooncake_jax.model.engine import Engine
    from mooncake_jax.model.llama import param_bytes
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.instance.server import build_engine
    from mooncake_jax.sharding.layout import MeshLayout
    from mooncake_jax.sharding.mesh import MeshSpec

    model = build_model(cfg.model, seed=0)
    if spmd and not multi:
        from mooncake_jax.sharding.spmd import SpmdLayout

        engine = Engine(model, layout=SpmdLayout(model.cfg, MeshSpec(2, a.tensor)), prefill_chunk_size=a.chunk,
                        max_batch=1, num_pages=cfg.num_pages, prefix_caching=False)
    elif spmd:
        engine = build_engine(cfg, model)
    else:
        engine = Engine(model, layout=MeshLayout(model.cfg, MeshSpec(2, a.tensor)), prefill_chunk_size=a.chunk,
                        max_batch=1, num_pages=cfg.num_pages, prefix_caching=False)
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, a.tokens).tolist()
    sending = []  # seconds process 0 spends handing each prefill's inputs to the other process (StepChannel)
    if multi:
        channel, send = engine.runner.channel, engine.runner.channel.send

        def timed_send(message):
            t = time.perf_counter()
            send(message)
            sending.append(time.perf_counter() - t)

        channel.send = timed_send
    times = []
    for i in range(a.repeats + 1):  # the first compiles
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
        engine.admit(seq, cached_pages=[])
        t0 = time.perf_counter()
        engine.prefill(seq)
        times.append(time.perf_counter() - t0)
        engine.release(seq)
    if multi:
        stop_followers(engine.runner.channel)
    params = param_bytes(model) // np.dtype(model.cfg.param_dtype).itemsize
    print(json.dumps({"best_s": min(times[1:]), "median_s": float(np.median(times[1:])), "compile_s": times[0],
                      "params": int(params), "global_devices": jax.device_count(),
                      "send_s": float(np.median(sending[-a.repeats:])) if sending else 0.0}), flush=True)
    if multi:
        jax.distributed.shutdown()


def launch(args: list[str], a) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, __file__, "--model", a.model, "--tokens", str(a.tokens), "--chunk",
                             str(a.chunk), "--repeats", str(a.repeats), "--tensor", str(a.tensor), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(procs: list[subprocess.Popen], timeout: float) -> dict:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"benchmark worker failed ({p.returncode}): {err[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens", type=int, default=512, help="prompt length")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk size (512 / 128: 4 chunks)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tensor", type=int, default=4, help="tensor-parallel devices per stage (= per process)")
    p.add_argument("--worker", default=None,
                   help="internal: run one measuring process (single, pipeline, or a process id of the group)")
    p.add_argument("--coordinator", default="")
    a = p.parse_args()
    if a.worker is not None:
        worker(a)
        return
    results = {"cpu_model": cpu_model(), "load_avg_1m_before": os.getloadavg()[0], "model": a.model,
               "prompt_tokens": a.tokens, "chunk": a.chunk, "shape": f"stage=2,tensor={a.tensor}", "repeats": a.repeats}
    results["matmul_peak_gflops"] = round(matmul_peak_gflops(), 1)
    budget = 400
    single = result_of([launch(["--worker", "single"], a)], budget)
    pipeline = result_of([launch(["--worker", "pipeline"], a)], budget)
    coordinator = f"127.0.0.1:{free_port()}"
    multi = result_of([launch(["--worker", str(i), "--coordinator", coordinator], a) for i in range(2)], budget)
    flops = 2 * single["params"] * a.tokens
    for name, r in (("single_process_spmd", single), ("single_process_cpp_runner", pipeline),
                    ("two_process_spmd", multi)):
        results[f"{name}_prefill_s"] = round(r["median_s"], 5)
        results[f"{name}_prefill_best_s"] = round(r["best_s"], 5)
        results[f"{name}_compile_s"] = round(r["compile_s"], 2)
        results[f"{name}_gflops"] = round(flops / r["median_s"] / 1e9, 2)
        results[f"{name}_fraction_of_matmul_peak"] = round(flops / r["median_s"] / 1e9 / results["matmul_peak_gflops"],
                                                           4)
    results["two_process_over_single_process"] = round(multi["median_s"] / single["median_s"], 3)
    results["two_process_step_broadcast_s"] = round(multi["send_s"], 5)  # part of two_process_spmd_prefill_s
    results["load_avg_1m_after"] = os.getloadavg()[0]
    write_json(results, a.json)


if __name__ == "__main__":
    main()
