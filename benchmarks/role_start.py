"""Time from ``mooncake-jax instance`` start to serving, cold and with the persistent compile cache.

A Conductor runs in this process; each measured start launches ``mooncake-jax instance --role R --conductor ...``
and stops the clock at its ready line (registered with the Conductor, its health service SERVING). The instance
compiles every step shape of its role before it registers (the default warm-up) and takes its cost profile from a
file (a deployment's measured profile; measuring it at start would add the calibration). ``cold``: an empty
compile-cache folder; ``cached``: the same folder again, so the programs load instead of compiling. The floor,
measured in the same run: a process that only imports JAX and lists its devices (``jax_process_floor_s``).
The machine is shared: the load average is written beside the figures.

    python benchmarks/role_start.py --json results/role_start.json
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
from common import arg_parser, cpu_model, write_json  # noqa: E402


def _profile() -> str:
    from mooncake_jax.conductor.profile import build_profile

    return json.dumps(build_profile(
        "tiny@bench", "tiny", [(16, 0, 0.01), (64, 0, 0.012), (256, 0, 0.02), (256, 128, 0.015), (512, 0, 0.04)],
        [(1, 64, 0.003), (4, 256, 0.004), (16, 2048, 0.008)], kv_bytes_per_token=16384, nic_bytes_per_s=5e8,
        kv_capacity_tokens=100000))


def start_to_serving(argv: list[str], timeout_s: float = 600) -> float:
    """Seconds from launching ``argv`` to its ready line; the process is then stopped (SIGTERM)."""
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        elapsed = time.perf_counter() - t
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"{argv[:6]} did not become ready (exit {proc.poll()})")
        return elapsed
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def main() -> None:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--roles", default="prefill", help="comma-separated roles to measure (prefill, decode)")
    args = p.parse_args()
    from mooncake_jax.conductor.api import PolicyConfig
    from mooncake_jax.conductor.service import serve

    conductor = serve(PolicyConfig(block_size=16), port=0, adopt_block_size=True)
    results: dict = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "model": args.model,
                     "load_average_start": round(os.getloadavg()[0], 2)}
    floor_argv = [sys.executable, "-c", "import jax; jax.devices(); print('{\"ready\": true}', flush=True)"]
    results["jax_process_floor_s"] = round(start_to_serving(floor_argv), 2)
    with tempfile.TemporaryDirectory(prefix="mooncake-bench-start-") as tmp:
        profile = Path(tmp) / "profile.json"
        profile.write_text(_profile())
        for role in args.roles.split(","):
            cache = Path(tmp) / f"cache-{role}"
            argv = [sys.executable, "-m", "mooncake_jax.cli", "instance", "--role", role, "--model", args.model,
                    "--conductor", conductor.address, "--listen", "127.0.0.1:0", "--profile-file", str(profile),
                    "--compile-cache", str(cache)]
            results[f"{role}_start_cold_s"] = round(start_to_serving(argv), 2)
            results[f"{role}_start_cached_s"] = round(start_to_serving(argv), 2)
            results[f"{role}_start_no_warmup_s"] = round(start_to_serving([*argv, "--no-warmup"]), 2)
    conductor.stop(0)
    results["load_average_end"] = round(os.getloadavg()[0], 2)
    write_json(results, args.json)


if __name__ == "__main__":
    main()
