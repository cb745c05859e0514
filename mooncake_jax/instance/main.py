"""One instance as its own process: ``python -m mooncake_jax.instance.main --role prefill --conductor HOST:PORT``.

Its configuration is an ``InstanceConfig`` (``config.py``): given whole as ``--config JSON`` (what a cluster passes
its children), field by field as flags, or both (flags win). Its SLOs come from the Conductor at registration.

When ready it prints one JSON line on stdout (``{"ready": true, "instance_id", "address", "profile_json"}``) and
serves until SIGTERM/SIGINT, or until its standard input closes: the parent that started it holds the other end,
so an instance never outlives the cluster that started it (no orphans, even if the parent is killed).

An instance over several processes (hosts): start one process per ``--process-id 0..N-1``, each with the same
flags and ``--coordinator HOST:PORT --num-processes N`` (``distributed.py``). Process 0 serves and prints the ready
line; the others follow it and exit when it stops.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from ..model.compile_cache import enable_compilation_cache
from .conductor_link import DECODE, PREFILL
from .config import InstanceConfig
from .devices import reserve_cpu_devices
from .server import InstanceServer


FLAGS = {  # flag -> InstanceConfig field (defaults: the config's own; ``--config`` gives them all at once)
    "--role": "role", "--conductor": "conductor_address", "--model": "model", "--instance-id": "instance_id",
    "--host": "host", "--port": "port", "--seed": "seed", "--dtype": "dtype", "--block-size": "block_size",
    "--tensor-parallel": "tensor_parallel", "--pipeline-stages": "pipeline_stages", "--devices": "devices",
    "--prefill-chunk-size": "prefill_chunk_size", "--max-batch": "max_batch", "--num-pages": "num_pages",
    "--hardware": "hardware", "--coordinator": "coordinator", "--num-processes": "num_processes",
    "--process-id": "process_id",
}
_INT_FIELDS = {"port", "seed", "block_size", "tensor_parallel", "pipeline_stages", "prefill_chunk_size", "max_batch",
               "num_pages", "num_processes", "process_id"}


def parse_args(argv=None) -> InstanceConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="the whole InstanceConfig as JSON (what a cluster passes)")
    for flag, name in FLAGS.items():
        p.add_argument(flag, dest=name, default=None, type=int if name in _INT_FIELDS else str,
                       choices=[PREFILL, DECODE] if name == "role" else None)
    p.add_argument("--pool-dram-blocks", type=int, default=None)
    p.add_argument("--pool-ssd-path", default=None)
    p.add_argument("--layerwise", action="store_true", default=None)
    p.add_argument("--profile-file", type=Path, default=None, help="cost profile JSON (default: measure at start)")
    p.add_argument("--no-warmup", action="store_true", help="compile step shapes on first use instead of at start")
    p.add_argument("--auth-token-stdin", action="store_true",
                   help="read the cluster's shared token from the first line of standard input")
    p.add_argument("--compile-cache", default="", help="persistent XLA cache folder ('none' to disable; "
                                                          "default: the user's cache directory)")
    a = p.parse_args(argv)
    try:
        fields = json.loads(a.config) if a.config else {}
    except json.JSONDecodeError as e:
        p.error(f"--config is not JSON: {e}")
    fields.update({name: getattr(a, name) for name in FLAGS.values() if getattr(a, name) is not None})
    pool = dict(fields.get("pool") or {})
    if a.pool_dram_blocks is not None:
        pool["dram_blocks"] = a.pool_dram_blocks
    if a.pool_ssd_path is not None:
        pool["ssd_path"] = a.pool_ssd_path
    fields["pool"] = pool
    if a.layerwise:
        fields["layerwise"] = True
    if a.no_warmup:
        fields["warmup"] = False
    if "role" not in fields or "conductor_address" not in fields:
        p.error("an instance needs --role and --conductor (or both in --config)")
    try:
        config = InstanceConfig.from_dict(
            fields, auth_token=sys.stdin.readline().strip() or None if a.auth_token_stdin else None,
            profile_json=a.profile_file.read_text() if a.profile_file else None)
    except ValueError as e:
        p.error(str(e))
    if a.compile_cache != "none":
        enable_compilation_cache(a.compile_cache or None)
    return config


SWITCH_INTERVAL_S = 0.0005
"""GIL switch interval of serving processes. A thread waiting for the GIL (the compute thread after a step, a gRPC
thread with a token to send) waits up to this long for the holder to yield: 5 ms by default, longer than a small
model's decode step."""


def settle_serving_process() -> None:
    """Tune this process for serving once its servers are up (instances here; ``serve`` and ``demo`` for the
    gateway). Everything alive now (JAX, the model, compiled programs: millions of objects) stays for the process's
    life: freezing it keeps a full garbage collection (~90 ms measured) from walking it while requests run, a pause
    every running stream would see as a token gap."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    config = parse_args(argv)
    if config.num_processes > 1:  # one instance over several processes: join them before JAX starts
        from ..model.config import get_config
        from .distributed import join_group, run_follower

        try:  # refuse a shape the model cannot take before any process waits for the others
            config.validate_for(get_config(config.model))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        reserve_cpu_devices(config.device_count // config.num_processes)
        join_group(config.coordinator, config.num_processes, config.process_id, config.coordinator_timeout_s)
        if config.process_id != 0:
            return run_follower(config)
    if config.devices:  # on the CPU platform, have the device ids this instance owns (before JAX starts)
        reserve_cpu_devices(max(config.devices) + 1)
    server = InstanceServer(config)
    try:
        server.start()
    except BaseException:
        if config.num_processes > 1:  # the followers would wait for process 0's operations until JAX's heartbeat
            from .distributed import stop_followers

            stop_followers(server.engine.runner.channel)
        raise
    settle_serving_process()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def lifeline():
        sys.stdin.read()  # returns at EOF: the parent is gone or wants us to stop
        stop.set()

    threading.Thread(target=lifeline, daemon=True).start()
    print(json.dumps({"ready": True, "instance_id": config.instance_id, "address": server.address,
                      "profile_json": server.profile_json}), flush=True)
    stop.wait()
    server.stop()
    if config.num_processes > 1:
        from .distributed import stop_followers

        stop_followers(server.engine.runner.channel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
