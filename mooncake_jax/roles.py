"""What the role commands (``mooncake-jax conductor | instance | gateway``) share: the token and TLS flags, listen
addresses, stopping on SIGTERM/SIGINT, and waiting for a Conductor that may not be up yet.

Each role is one long-running process that logs to stderr, prints one JSON line on stdout once it serves (with
the ports it bound, so port 0 works under a launcher), and stops cleanly on SIGTERM or SIGINT. Nothing here imports
JAX: the Conductor and the gateway start in a second.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

import grpc

from .addresses import is_loopback, split

log = logging.getLogger("mooncake_jax.roles")

EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
"""Exit status of a role that gave up waiting for the Conductor (a process manager restarts it)."""

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0


class Unreachable(RuntimeError):
    """A peer that did not answer within the time it was given; the message says which and for how long."""


def parse_address(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); ValueError naming ``flag`` otherwise. Port 0: a free one."""
    host, port = split(text or "")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag} must be HOST:PORT (port 0-65535, 0: a free one), got {text!r}")
    return host, int(port)


def add_security_arguments(p) -> None:
    """The shared token and TLS flags every role takes."""
    p.add_argument("--auth-token", default=None,
                   help="shared token every RPC between the cluster's processes (and every client call) carries "
                        "(visible in ps: prefer --auth-token-file or the MOONCAKE_API_KEY environment variable)")
    p.add_argument("--auth-token-file", default=None, help="file whose first line is the shared token")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC (and HTTP) over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None,
                   help="PEM CA bundle the other roles' certificates chain to (default: --tls-cert itself)")


def add_child_arguments(p) -> None:
    """The flags a launcher (``serve``) gives the role processes it starts and supervises."""
    p.add_argument("--auth-token-stdin", action="store_true",
                   help="read the cluster's shared token from the first line of standard input")
    p.add_argument("--exit-with-stdin", action="store_true",
                   help="stop when standard input closes (a launcher's children: they never outlive it)")


def read_stdin_token(args) -> None:
    """With ``--auth-token-stdin``, the token from the first line of standard input (``setup`` returns it)."""
    if args.auth_token_stdin:
        args.auth_token_from_stdin = sys.stdin.readline().strip() or None


def exit_with_stdin(args, stop: threading.Event) -> None:
    """With ``--exit-with-stdin``, set ``stop`` once standard input closes (the launcher is gone or wants this
    process to stop)."""
    if not args.exit_with_stdin:
        return

    def lifeline():
        sys.stdin.read()  # returns at EOF
        stop.set()

    threading.Thread(target=lifeline, daemon=True, name="stdin-lifeline").start()


def setup(args, role: str) -> str | None:
    """Logging to stderr, TLS for the process, and the shared token (returned). ValueError saying what is wrong."""
    from .gateway.auth import resolve_token
    from .proto import tls

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    tls.configure(args.tls_cert, args.tls_key, args.tls_ca)
    token = getattr(args, "auth_token_from_stdin", None)
    if token is None:
        token = resolve_token(args.auth_token, args.auth_token_file, os.environ)
    return token


def check_exposed(host: str, token: str | None, what: str) -> None:
    """A server beyond loopback without the shared token would let anyone on the network use it."""
    if token is None and not is_loopback(host):
        raise ValueError(f"{what} listens on {host}, beyond loopback: give the shared token (--auth-token-file, "
                         f"--auth-token or MOONCAKE_API_KEY)")


def fail(role: str, error: Exception, status: int) -> int:
    """Say on stderr why the role does not start; returns the exit status."""
    print(f"mooncake-jax {role}: {error}", file=sys.stderr, flush=True)
    return status


def end_on_signals() -> None:
    """While a role starts, SIGTERM and SIGINT end the process at once (it is registered nowhere yet, and a start
    can spend minutes compiling): no traceback, no half-started server."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def stop_event() -> threading.Event:
    """An event set by SIGTERM or SIGINT (call from the main thread)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def announce(**fields) -> None:
    """The one JSON line on stdout that says the role serves (and on which ports)."""
    print(json.dumps({"ready": True, **fields}), flush=True)


def wait_for_conductor(address: str, timeout_s: float, who: str, stop: threading.Event | None = None) -> None:
    """Return once the Conductor at ``address`` answers its health service; until then retry with a doubling
    backoff, logging each try; ``Unreachable`` after ``timeout_s`` (or when ``stop`` is set)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .proto.auth import open_channel

    deadline = time.monotonic() + timeout_s
    delay = BACKOFF_FIRST_S
    with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=max(0.5, min(5.0, left)))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                problem = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as e:
                problem = e.code().name
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                raise Unreachable(f"{who}: the Conductor at {address} did not answer within {timeout_s:.0f} s "
                                  f"(last: {problem}); is it running, and is the address reachable from here?")
            wait_s = min(delay, left)
            log.warning("%s: the Conductor at %s does not answer (%s); retrying in %.1f s, giving up in %.0f s",
                        who, address, problem, wait_s, left)
            if stop is not None and stop.wait(wait_s):
                continue
            if stop is None:
                time.sleep(wait_s)
            delay = min(BACKOFF_MAX_S, delay * 2)
