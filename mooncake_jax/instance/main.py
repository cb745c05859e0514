"""One instance as its own process: ``mooncake-jax instance --role prefill --conductor HOST:PORT --listen HOST:PORT``.

Its configuration is an ``InstanceConfig`` (``config.py``): given whole as ``--config JSON`` (what a cluster passes
its children), field by field as flags, or both (flags win). Its SLOs come from the Conductor at registration.

When ready it prints one JSON line on stdout (``{"ready": true, "instance_id", "address", "port", "profile_json"}``)
and serves until SIGTERM/SIGINT. It is not tied to its standard input (it runs under a process manager or in a
container), except with ``--exit-with-stdin``, which ``serve`` gives its children: the parent holds the other end,
so such an instance never outlives the cluster that started it (no orphans, even if the parent is killed).

A Conductor that does not answer is retried with a backoff for ``--conductor-wait-s`` (default 60 s), each try
logged, before the model is even loaded; then the process exits with status 3 (a process manager restarts it).

An instance over several processes (hosts): start one process per ``--process-id 0..N-1``, each with the same
flags and ``--coordinator HOST:PORT --num-processes N`` (``distributed.py``). Process 0 serves and prints the ready
line; the others follow it and exit when it stops.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path

from .. import roles
from ..model import host_memory
from ..model.compile_cache import enable_compilation_cache
from ..roles import add_security_arguments, parse_address
from .conductor_link import DECODE, PREFILL
from . import cpus, sched_slice
from .config import InstanceConfig
from ..transfer.messenger import DATA_PLANES
from .devices import reserve_cpu_devices
from .server import InstanceServer, RegistrationError

log = logging.getLogger("mooncake_jax.instance")


FLAGS = {  # flag -> InstanceConfig field (defaults: the config's own; ``--config`` gives them all at once)
    "--role": "role", "--conductor": "conductor_address", "--model": "model", "--instance-id": "instance_id",
    "--host": "host", "--port": "port", "--seed": "seed", "--dtype": "dtype", "--block-size": "block_size",
    "--tensor-parallel": "tensor_parallel", "--pipeline-stages": "pipeline_stages", "--devices": "devices",
    "--cpus": "cpus",
    "--prefill-chunk-size": "prefill_chunk_size", "--max-batch": "max_batch", "--num-pages": "num_pages",
    "--hardware": "hardware", "--coordinator": "coordinator", "--num-processes": "num_processes",
    "--process-id": "process_id", "--coordinator-timeout-s": "coordinator_timeout_s",
}
_INT_FIELDS = {"port", "seed", "block_size", "tensor_parallel", "pipeline_stages", "prefill_chunk_size", "max_batch",
               "num_pages", "num_processes", "process_id"}


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="the whole InstanceConfig as JSON (what a cluster passes)")
    for flag, name in FLAGS.items():
        p.add_argument(flag, dest=name, default=None,
                       type=int if name in _INT_FIELDS else float if name == "coordinator_timeout_s" else str,
                       choices=[PREFILL, DECODE] if name == "role" else None)
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="address to serve on (port 0: a free one; the same as --host and --port)")
    p.add_argument("--advertise", default=None, metavar="HOST[:PORT]",
                   help="address the Conductor, the gateway and the other instances reach this one at, when not "
                        "the listen address (NAT, containers); without a port: the one bound")
    p.add_argument("--conductor-wait-s", type=float, default=None,
                   help="retry a Conductor that does not answer this long before giving up (default 60)")
    p.add_argument("--pool-dram-blocks", type=int, default=None)
    p.add_argument("--pool-ssd-path", default=None)
    p.add_argument("--layerwise", action="store_true", default=None)
    p.add_argument("--data-plane", default=None, choices=DATA_PLANES,
                   help="how block data moves to and from other instances: auto (default: the socket plane where "
                        "both ends serve it and TLS is off, else gRPC), grpc (and serve no socket plane), jax, socket")
    p.add_argument("--profile-file", type=Path, default=None, help="cost profile JSON (default: measure at start)")
    p.add_argument("--no-warmup", action="store_true", help="compile step shapes on first use instead of at start")
    p.add_argument("--compile-cache", default="", help="persistent XLA cache folder ('none' to disable; "
                                                          "default: the user's cache directory)")
    add_security_arguments(p)
    roles.add_child_arguments(p)


def config_from_args(a, auth_token: str | None) -> InstanceConfig:
    """The InstanceConfig the flags describe; ValueError saying which flag is wrong."""
    try:
        fields = json.loads(a.config) if a.config else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--config is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--config must be a JSON object, got {type(fields).__name__}")
    fields.update({name: getattr(a, name) for name in FLAGS.values() if getattr(a, name) is not None})
    if a.listen is not None:
        if a.host is not None or a.port is not None:
            raise ValueError("give --listen or --host/--port, not both")
        fields["host"], fields["port"] = parse_address(a.listen, "--listen")
    if a.advertise is not None:
        fields["advertise"] = a.advertise
    if a.conductor_wait_s is not None:
        fields["conductor_wait_s"] = a.conductor_wait_s
    pool = dict(fields.get("pool") or {})
    if a.pool_dram_blocks is not None:
        pool["dram_blocks"] = a.pool_dram_blocks
    if a.pool_ssd_path is not None:
        pool["ssd_path"] = a.pool_ssd_path
    fields["pool"] = pool
    if a.layerwise:
        fields["layerwise"] = True
    if a.data_plane is not None:
        fields["data_plane"] = a.data_plane
    if a.no_warmup:
        fields["warmup"] = False
    if "role" not in fields or "conductor_address" not in fields:
        raise ValueError("an instance needs --role and --conductor (or both in --config)")
    parse_address(fields["conductor_address"], "--conductor")
    try:
        profile_json = a.profile_file.read_text() if a.profile_file else None
    except OSError as e:
        raise ValueError(f"--profile-file: {e}") from None
    return InstanceConfig.from_dict(fields, auth_token=auth_token, profile_json=profile_json)


def parse_args(argv=None) -> InstanceConfig:
    """The InstanceConfig of a command line (exits with a usage error when it is wrong)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        return config_from_args(a, sys.stdin.readline().strip() or None if a.auth_token_stdin else None)
    except ValueError as e:
        p.error(str(e))


SWITCH_INTERVAL_S = 0.0001
"""GIL switch interval of serving processes. A thread waiting for the GIL (the compute thread after a step, a gRPC
thread with a token to send) waits up to this long for the holder to yield: 5 ms by default, longer than a small
model's decode step. 0.5 ms until the seventeenth session; at 0.1 ms a stream's message read beside a thread that
keeps the lock busy arrived in 0.30-0.34 ms at the median against 0.70-0.73 ms (``benchmarks/stream_latency.py --busy``,
AMD EPYC, 2 cores; docs/benchmarks/demo.md, "seventeenth session")."""


def tune_allocator(role: str) -> None:
    """A prefill instance's threads share one malloc arena: its long prefills' temporaries (140 MB for 2,048 tokens
    of the ``small`` preset) outgrow a thread arena's heaps and would be mapped afresh every call. A decode
    instance's steps fit a thread's own heap, and one shared arena would slow each of them (``host_memory.py``)."""
    if role == PREFILL:
        host_memory.share_one_arena()


def tune_dispatch(role: str) -> None:
    """A decode instance runs its XLA:CPU programs on the thread that calls them (no effect off CPU). Its compute
    thread reads every step's tokens before it starts the next, so handing the program to an executor thread
    overlaps nothing: it only adds a wake-up, which on cores shared with prefill processes preempts the compute
    thread and can leave it queued behind a prefill's products until the next scheduler tick (4 ms at 250 Hz;
    traced with ``perf sched``, docs/benchmarks/demo.md, "twenty-first session"). Call before JAX starts."""
    if role == DECODE:
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)


def settle_serving_process(carries_tokens: bool) -> None:
    """Tune this process for serving once its servers are up (instances here; ``serve`` and ``demo`` for the
    gateway). Everything alive now (JAX, the model, compiled programs: millions of objects) stays for the process's
    life: freezing it keeps a full garbage collection (~90 ms measured) from walking it while requests run, a pause
    every running stream would see as a token gap. A process that ``carries_tokens`` (a decode instance, a gateway)
    asks for short CPU slices (``sched_slice.py``), so its threads run soon after they wake."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if carries_tokens:
        sched_slice.prefer_short_slices()


def _stop_followers(config: InstanceConfig, server: InstanceServer | None) -> None:
    """Release the other processes of a multi-process instance (they wait for process 0's operations)."""
    if config.num_processes > 1 and server is not None:
        from .distributed import stop_followers

        stop_followers(server.engine.runner.channel)


def run(args) -> int:
    """``mooncake-jax instance``: one prefill or decode instance until SIGTERM/SIGINT (or, with
    ``--exit-with-stdin``, until standard input closes). Nothing is left running when it cannot start."""
    roles.read_stdin_token(args)
    try:
        token = roles.setup(args, "instance")
        config = config_from_args(args, token)
        roles.check_exposed(config.host, token, "the instance")
        cpus.pin(config.cpus)  # before JAX starts: XLA sizes its thread pool to the cores this process may use
        tune_allocator(config.role)  # before JAX starts its threads, which take their malloc arenas then
        tune_dispatch(config.role)
        if config.num_processes > 1:  # refuse a shape the model cannot take before any process waits for others
            from ..model.config import get_config

            config.validate_for(get_config(config.model))
    except ValueError as e:
        return roles.fail("instance", e, roles.EXIT_BAD_INPUT)
    if args.compile_cache != "none":
        enable_compilation_cache(args.compile_cache or None)
    roles.end_on_signals()
    if config.process_id == 0:  # before minutes of loading and compiling: is there a Conductor to serve?
        try:
            roles.wait_for_conductor(config.conductor_address, config.conductor_wait_s, config.instance_id)
        except roles.Unreachable as e:
            return roles.fail("instance", e, roles.EXIT_UNREACHABLE)
    if config.num_processes > 1:  # one instance over several processes: join them before JAX starts
        from .distributed import join_group, run_follower

        reserve_cpu_devices(config.device_count // config.num_processes)
        join_group(config.coordinator, config.num_processes, config.process_id, config.coordinator_timeout_s,
                   config.collectives_host)
        if config.process_id != 0:
            return run_follower(config)
    if config.devices:  # on the CPU platform, have the device ids this instance owns (before JAX starts)
        reserve_cpu_devices(max(config.devices) + 1)
    server = None
    try:
        server = InstanceServer(config)
        server.start()
    except RegistrationError as e:
        _stop_followers(config, server)
        return roles.fail("instance", e, roles.EXIT_UNREACHABLE)
    except (ValueError, OSError) as e:
        _stop_followers(config, server)
        return roles.fail("instance", e, roles.EXIT_BAD_INPUT)
    except BaseException:
        _stop_followers(config, server)
        raise
    stop = roles.stop_event()
    roles.exit_with_stdin(args, stop)
    settle_serving_process(carries_tokens=config.role == DECODE)
    log.info("%s instance %s serving on %s:%d, registered as %s", config.role, config.instance_id, config.host,
             server.port, server.address)
    roles.announce(instance_id=config.instance_id, address=server.address, port=server.port,
                   profile_json=server.profile_json)
    stop.wait()
    log.info("%s stopping", config.instance_id)
    server.stop()
    _stop_followers(config, server)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
