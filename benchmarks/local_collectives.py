"""What a collective that never leaves a process costs once the CPU backend has gloo collectives (a multi-process
instance) against the same collective in one process: a psum over the ``tensor`` axis of a (stage=2, tensor=4)
mesh, whose groups are each inside one process when the 8 devices are 2 processes x 4.

Why: the two-process SPMD prefill (``multiprocess_prefill.py``) is 2-2.5x the one-process one on the same devices,
and the extra grows with tensor parallelism; this isolates the tensor all-reduce. The physical limit beside it is
this host's memcpy bandwidth, measured in the same run (the bytes a 4-way all-reduce moves, at memory speed).

    python benchmarks/local_collectives.py --json results/local_collectives.json
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
from common import arg_parser, cpu_model, memcpy_gbps, write_json  # noqa: E402

SHAPE = (2, 4, 128, 256)  # [stage, tensor, rows, cols] float32: one 128 KiB shard per device
REPEATS = 50


def worker(process_id: int, coordinator: str) -> None:
    """One measuring process: ``process_id`` -1 is the single process of 8 devices, else one of a 2-process group."""
    import jax
    import numpy as np

    if process_id < 0:
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        jax.config.update("jax_num_cpu_devices", 4)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "tensor"))
    host = np.ones(SHAPE, np.float32)
    x = jax.make_array_from_callback(SHAPE, NamedSharding(mesh, P("stage", "tensor")), lambda i: host[i])
    psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "tensor"), mesh=mesh, in_specs=P("stage", "tensor"),
                                 out_specs=P("stage", "tensor")))
    jax.block_until_ready(psum(x))
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        jax.block_until_ready(psum(x))
        times.append(time.perf_counter() - t)
    print(json.dumps({"median_s": float(np.median(times)), "best_s": min(times)}), flush=True)
    if process_id >= 0:
        jax.distributed.shutdown()


def run(args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def result(procs: list[subprocess.Popen]) -> dict:
    outs = []
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a measuring process failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--worker", type=int, default=None, help="internal: -1 single process, else a process id")
    p.add_argument("--coordinator", default="")
    a = p.parse_args()
    if a.worker is not None:
        worker(a.worker, a.coordinator)
        return
    results = {"cpu_model": cpu_model(), "load_avg_1m_before": os.getloadavg()[0], "shape": list(SHAPE),
               "repeats": REPEATS, "memcpy_gbps": round(memcpy_gbps(), 2)}
    single = result([run(["--worker", "-1"])])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    group = result([run(["--worker", str(i), "--coordinator", coordinator]) for i in range(2)])
    shard_bytes = 4 * SHAPE[2] * SHAPE[3]
    results["one_process_psum_s"] = round(single["median_s"], 6)
    results["two_process_psum_s"] = round(group["median_s"], 6)
    results["two_process_over_one_process"] = round(group["median_s"] / single["median_s"], 2)
    # a 4-way ring all-reduce moves 2 x 3/4 of a shard per device, 8 devices: its time at memcpy speed
    results["memcpy_floor_s"] = round(8 * 2 * 0.75 * shard_bytes / (results["memcpy_gbps"] * 1e9), 6)
    results["load_avg_1m_after"] = os.getloadavg()[0]
    write_json(results, a.json)


if __name__ == "__main__":
    main()
