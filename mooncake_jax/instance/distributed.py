"""An instance over several processes (and hosts) on JAX's multi-controller runtime (``jax.distributed``).

Every process of the instance runs ``instance.main`` with the same configuration but its own ``process_id``:

1. ``join_group`` connects it to the instance's coordinator (process 0 hosts it) before JAX starts its backends,
   with gloo collectives on CPU, so ``jax.devices()`` becomes the global device list of all processes. If the group
   does not form within ``coordinator_timeout_s`` the process logs why and exits (JAX's own timeout aborts the
   process with a C++ stack trace; this fires first, with a message that names the coordinator and the count);
   nothing else has been started yet, so nothing is left behind.
2. Every process builds the same model and engine over the one global (stage, tensor) mesh
   (``sharding.spmd.SpmdLayout``). Process 0 is the control plane: gRPC server, scheduler, Conductor link. The
   others run ``follow``: they execute each device operation process 0 sends through the ``StepChannel``, until
   process 0 sends ``STOP`` (when it stops, or fails to start) or dies: then JAX's coordination agent ends them at
   once (measured: it aborts the process, with its own log line, when the service in process 0 goes away); should
   it not, their wait for the next operation fails and they exit with ``LOST_LEADER_EXIT``, and a process that
   stops answering JAX's heartbeat ends the others within ``HEARTBEAT_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from ..sharding.step_channel import STOP, StepChannel

log = logging.getLogger(__name__)

GROUP_FAILED_EXIT = 3
"""Exit status of a process whose group did not form in time."""

LOST_LEADER_EXIT = 4
"""Exit status of a follower whose process 0 went away without stopping it (it died)."""

HEARTBEAT_TIMEOUT_S = 30
"""A process of the group that stops answering JAX's heartbeat for this long (it died) ends the others: followers
never wait long for a process 0 that is gone (JAX's default is 100 s)."""


def _collectives_on(host: str) -> None:
    """Have the CPU backend's gloo collectives listen on ``host`` (this process's address in the group).

    JAX (0.10) builds them with no host, so gloo listens on whatever the machine's hostname resolves to: often a
    loopback address (``127.0.1.1`` on Debian-likes, ``127.0.0.1`` here), which the group's processes on other
    hosts then fail to reach, in a hang rather than an error. JAX has no public option for it: the CPU backend's
    factory is registered again, the same one plus the host (before any backend starts)."""
    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax

        def make_cpu_client():
            collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                         hostname=host)
            return xla_bridge.make_cpu_client(collectives)

        xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)
    except (ImportError, AttributeError, TypeError) as e:  # another JAX: its own default (the hostname)
        log.warning("cannot set the collectives' address to %s on this JAX (%s): gloo uses the hostname's", host, e)


def join_group(coordinator: str, num_processes: int, process_id: int, timeout_s: float,
               collectives_host: str | None = None) -> None:
    """Join the instance's process group (blocking until all ``num_processes`` have joined).

    Exits the process with status ``GROUP_FAILED_EXIT`` and a clear log line if the group has not formed after
    ``timeout_s`` seconds. Must run before anything touches a JAX backend. ``collectives_host``: the address the
    other processes reach this one's collectives at (None: the machine's hostname).
    """
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is out of range for num_processes={num_processes}; "
                         f"allowed: 0 to {num_processes - 1}")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def give_up():
        message = (f"process {process_id} of {num_processes}: the process group at coordinator {coordinator} did "
                   f"not form within {timeout_s:g} s (is every process started, with the same --coordinator and "
                   f"--num-processes, and is the coordinator reachable?); exiting")
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(GROUP_FAILED_EXIT)

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        # JAX's own limit (an abort) stays beyond ours, so the watchdog always speaks first.
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=int(timeout_s) + 60,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
        if collectives_host is not None:
            _collectives_on(collectives_host)
        jax.devices()  # the global device list: every process has joined once this returns
    finally:
        watchdog.cancel()
    log.info("process %d of %d joined the group at %s: %d global devices, %d local", process_id, num_processes,
             coordinator, jax.device_count(), jax.local_device_count())


def follow(runner, channel: StepChannel) -> int:
    """Run every operation process 0 sends, on this process's share of the mesh, until ``STOP``; returns how many
    ran."""
    done = 0
    while True:
        op, payload = channel.recv()
        if op == STOP:
            return done
        runner.execute(op, payload)
        done += 1


def stop_followers(channel: StepChannel | None) -> None:
    """Tell the other processes to leave ``follow`` (process 0, when the instance stops)."""
    if channel is not None and channel.is_leader:
        channel.send((STOP, None))


def run_follower(config) -> int:
    """A process other than 0 of a multi-process instance: the same model and engine as process 0 (which builds
    its own in ``InstanceServer``), following process 0's operations until it stops. Returns the exit status."""
    import jax

    from ..llm import build_model
    from .server import build_engine

    model = build_model(config.model, dtype=config.dtype, block_size=config.block_size, seed=config.seed)
    config.validate_for(model.cfg)
    engine = build_engine(config, model)
    runner = engine.runner
    print(f"process {config.process_id} of {config.num_processes} of {config.role} instance following "
          f"{config.coordinator}", file=sys.stderr, flush=True)
    try:
        done = follow(runner, runner.channel)
    except Exception as e:  # the coordination service (in process 0) is gone: process 0 died
        message = (f"process {config.process_id} of {config.num_processes}: lost process 0 at {config.coordinator} "
                   f"({type(e).__name__}: {e}); exiting")
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(LOST_LEADER_EXIT)  # holds no server or registration; JAX's exit hooks would wait for the dead
    log.info("process %d: process 0 stopped the instance after %d operations", config.process_id, done)
    jax.distributed.shutdown()
    return 0
