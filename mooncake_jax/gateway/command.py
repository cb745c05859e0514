"""``mooncake-jax gateway --conductor HOST:PORT --host HOST --http-port H --grpc-port G``: the gateway alone.

It keeps no list of instances: for every request it asks the Conductor, which answers with the instances' addresses
(``instance/backend.py``), so a restarted gateway loses nothing and finds every instance at once. Without
``--model`` it serves the model the Conductor's instances registered with (it waits for the first one).
"""

from __future__ import annotations

import logging
import threading
import time

from .. import roles

log = logging.getLogger("mooncake_jax.gateway")

MODEL_POLL_S = 1.0


def add_arguments(p) -> None:
    p.add_argument("--conductor", required=True, metavar="HOST:PORT", help="the Conductor's address")
    p.add_argument("--host", default="127.0.0.1", help="address both front ends listen on")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC port (0: a free one, printed at start)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port (0: a free one, printed at start)")
    p.add_argument("--model", default=None,
                   help="preset name or Hugging Face folder (default: the model the cluster's instances registered)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder), or 'bytes'")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file for /v1/chat/completions")
    p.add_argument("--cors-origin", action="append", default=[], help="browser origin allowed to call the HTTP API")
    p.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds open requests get to finish before they are ended")
    p.add_argument("--conductor-wait-s", type=float, default=60.0,
                   help="retry a Conductor that does not answer (or lists no instance yet) this long, then exit")
    roles.add_security_arguments(p)


def cluster_model(conductor: str, token: str | None, timeout_s: float, stop, model: str | None = None):
    """(model, prefix-index block size) of the Conductor's cluster: the model its instances registered (waiting up
    to ``timeout_s`` for the first unless ``model`` is given); block size 0 while no prefill instance fixed it."""
    from ..instance.backend import conductor_messages, conductor_services
    from ..proto.auth import open_channel

    deadline = time.monotonic() + timeout_s
    said = False
    with open_channel(conductor, token) as channel:
        stub = conductor_services.ConductorStub(channel)
        while True:
            listing = stub.ListInstances(conductor_messages.ListInstancesRequest(), timeout=5)
            if model or listing.model:
                prefill = any(i.role == conductor_messages.PREFILL for i in listing.instances)
                return model or listing.model, listing.block_size if prefill else 0
            if time.monotonic() >= deadline or stop.is_set():
                raise roles.Unreachable(f"the Conductor at {conductor} lists no instance after {timeout_s:.0f} s, "
                                        f"so the model to serve is unknown: start an instance or give --model")
            if not said:
                log.info("waiting up to %.0f s for an instance to register with the Conductor (to learn the model)",
                         timeout_s)
                said = True
            stop.wait(MODEL_POLL_S)


def run(args) -> int:
    import grpc

    try:
        token = roles.setup(args, "gateway")
        roles.parse_address(args.conductor, "--conductor")
        for flag, port in (("--grpc-port", args.grpc_port), ("--http-port", args.http_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be 0-65535 (0: a free one), got {port}")
        roles.check_exposed(args.host, token, "the gateway")
        if args.model is not None:
            from .tokenizer import check_tokenizer_source

            check_tokenizer_source(args.model, args.tokenizer)
    except ValueError as e:
        return roles.fail("gateway", e, roles.EXIT_BAD_INPUT)
    roles.end_on_signals()
    never = threading.Event()
    try:
        roles.wait_for_conductor(args.conductor, args.conductor_wait_s, "gateway")
        model, block_size = cluster_model(args.conductor, token, args.conductor_wait_s, never, args.model)
    except roles.Unreachable as e:
        return roles.fail("gateway", e, roles.EXIT_UNREACHABLE)
    except grpc.RpcError as e:
        return roles.fail("gateway", f"the Conductor at {args.conductor} refused: {e.code().name}: {e.details()}",
                          roles.EXIT_UNREACHABLE)
    from ..instance.backend import ClusterBackend
    from ..instance.main import settle_serving_process
    from ..model.config import get_config
    from .server import GatewayServer

    backend = None
    try:
        config = get_config(model)
        if block_size and block_size != config.block_size:  # the prefill instances' pages (their block keys)
            config = config.replace(block_size=block_size)
        backend = ClusterBackend(args.conductor, config, model_name=model, auth_token=token)
        gateway = GatewayServer(backend, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                                auth_token=token, tokenizer=args.tokenizer, chat_template=args.chat_template,
                                drain_grace_s=args.drain_grace_s, cors_origins=tuple(args.cors_origin)).start()
    except (ValueError, OSError) as e:
        if backend is not None:
            backend.close()
        return roles.fail("gateway", e, roles.EXIT_BAD_INPUT)
    stop = roles.stop_event()
    settle_serving_process(carries_tokens=True)
    log.info("gateway of %s serving gRPC on %s:%d and HTTP on %s:%d (Conductor %s)", model, args.host,
             gateway.grpc_port, args.host, gateway.http_port, args.conductor)
    roles.announce(role="gateway", model=model, grpc_port=gateway.grpc_port, http_port=gateway.http_port)
    stop.wait()
    log.info("gateway draining (up to %.0f s)", args.drain_grace_s)
    gateway.stop()
    backend.close()
    return 0
