"""A local cluster's Conductor as its own process (what ``serve`` runs), restarted on the same address.

In one process with the gateway, a Conductor that dies takes the gateway with it, and recovery means restarting
everything. As a child process running the role command (``mooncake-jax conductor --listen HOST:PORT``), it is
supervised like the instances (``supervise.py``): killed, it is started again after a backoff on the port it
first bound, so the instances (which re-register with their block lists when their heartbeat gets NOT_FOUND) and
the gateway (whose channel reconnects within ``proto/auth.RECONNECT_OPTIONS``' backoff) find it where it was.
While it is away, new requests get 503 / UNAVAILABLE and requests already placed finish (they no longer need it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..addresses import join
from ..conductor.api import PolicyConfig

CARRIED_FIELDS = ("strategy", "admission", "block_size", "kvcache_balancing_threshold", "ttft_slo_s", "tbt_slo_s",
                  "seed")
"""The PolicyConfig fields the conductor command's flags carry; any other field must keep its default."""


def conductor_args(config: PolicyConfig, host: str, port: int, heartbeat_interval_s: float,
                   heartbeat_timeout_s: float) -> list[str]:
    """The ``mooncake-jax conductor`` flags that start a Conductor with ``config`` on ``host:port``; ValueError
    naming a field the flags cannot carry."""
    default = PolicyConfig()
    lost = [f.name for f in dataclasses.fields(PolicyConfig)
            if f.name not in CARRIED_FIELDS and getattr(config, f.name) != getattr(default, f.name)]
    if lost:
        raise ValueError(f"a Conductor process takes no {lost} (the conductor command has no flag for them); "
                         f"run the Conductor in this process instead")
    listen = join(host, port)
    return ["--listen", listen, "--policy", config.strategy.value, "--admission", config.admission.value,
            "--block-size", str(config.block_size),
            "--kvcache-balancing-threshold", repr(config.kvcache_balancing_threshold),
            "--ttft-slo-s", repr(config.ttft_slo_s), "--tbt-slo-s", repr(config.tbt_slo_s), "--seed", str(config.seed),
            "--heartbeat-interval-s", repr(heartbeat_interval_s), "--heartbeat-timeout-s", repr(heartbeat_timeout_s)]


class ConductorLauncher:
    """Starts the Conductor process, and starts it again on the same port: the first start binds a free port
    (port 0, read back from the process's ready line), every later one asks for that port.

    ``spawn(args)`` runs ``mooncake-jax conductor *args`` and returns the child once it serves (a ``ChildInstance``
    with ``info["port"]`` and ``.address``)."""

    def __init__(self, config: PolicyConfig, host: str, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 spawn: Callable[[list[str]], object]):
        conductor_args(config, host, 0, heartbeat_interval_s, heartbeat_timeout_s)  # refuse a bad config now
        self.config, self.host = config, host
        self.heartbeat = (heartbeat_interval_s, heartbeat_timeout_s)
        self._spawn = spawn
        self.port = 0
        self.starts = 0

    def start(self):
        child = self._spawn(conductor_args(self.config, self.host, self.port, *self.heartbeat))
        bound = int(child.info["port"])
        if self.port and bound != self.port:  # cannot happen with the role command; never serve a moved address
            child.stop()
            raise RuntimeError(f"the Conductor came back on port {bound}, not {self.port}")
        self.port = bound
        self.starts += 1
        return child
