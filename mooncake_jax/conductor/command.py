"""``mooncake-jax conductor --listen HOST:PORT``: the Conductor alone, as its own server.

It holds no state worth saving: instances register with it (and again, with their block lists, when it restarts:
they learn of the restart from NOT_FOUND on their next heartbeat), and the gateway asks it for every request. So
it is restarted like any stateless service, on the same address (``serve`` runs it as a supervised child process:
``instance/conductor_process.py``). The prefix index's block size is the first prefill instance's unless
``--block-size`` fixes it.
"""

from __future__ import annotations

import logging

from .. import roles

log = logging.getLogger("mooncake_jax.conductor")


def add_arguments(p) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to serve on (port 0: a free one)")
    p.add_argument("--policy", default="kvcache-centric",
                   choices=["random", "load-balance", "local-cache-aware", "kvcache-centric"])
    p.add_argument("--admission", default="predictive", choices=["none", "baseline", "early", "predictive"])
    p.add_argument("--ttft-slo-s", type=float, default=30.0)
    p.add_argument("--tbt-slo-s", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block of the prefix index (default: the first prefill instance's)")
    p.add_argument("--kvcache-balancing-threshold", type=float, default=1.0)
    p.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    p.add_argument("--heartbeat-timeout-s", type=float, default=3.0,
                   help="an instance silent this long is drained and its blocks purged")
    p.add_argument("--seed", type=int, default=0)
    roles.add_security_arguments(p)
    roles.add_child_arguments(p)


def run(args) -> int:
    from .api import PolicyConfig
    from .service import serve

    roles.read_stdin_token(args)
    try:
        token = roles.setup(args, "conductor")
        host, port = roles.parse_address(args.listen, "--listen")
        roles.check_exposed(host, token, "the Conductor")
        config = PolicyConfig(strategy=args.policy, admission=args.admission, ttft_slo_s=args.ttft_slo_s,
                              tbt_slo_s=args.tbt_slo_s, kvcache_balancing_threshold=args.kvcache_balancing_threshold,
                              seed=args.seed, **({"block_size": args.block_size} if args.block_size else {}))
        stop = roles.stop_event()
        server = serve(config, host=host, port=port, auth_token=token, heartbeat_interval_s=args.heartbeat_interval_s,
                       heartbeat_timeout_s=args.heartbeat_timeout_s, adopt_block_size=args.block_size is None)
    except (ValueError, OSError) as e:
        return roles.fail("conductor", e, roles.EXIT_BAD_INPUT)
    log.info("Conductor serving on %s (policy %s, admission %s)", server.address, args.policy, args.admission)
    roles.exit_with_stdin(args, stop)
    roles.announce(role="conductor", address=server.address, port=server.port)
    stop.wait()
    log.info("Conductor stopping")
    server.stop()
    return 0
