"""``mooncake-jax serve``: a whole local cluster behind the gateway.

Starts the Conductor, P prefill and D decode instance processes and the gateway (gRPC ``mooncake.v1.Gateway``
with health and reflection, OpenAI-compatible HTTP) on loopback, logs where each listens, and serves until
SIGINT/SIGTERM, then stops everything (instances are tied to this process and exit with it: no orphans).
``--coupled`` serves one engine doing both prefill and decode instead (the baseline, and the simplest server).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger("mooncake_jax.serve")


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or local Hugging Face folder")
    p.add_argument("--prefill", type=int, default=2, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--host", default="127.0.0.1", help="address every server listens on (default loopback)")
    p.add_argument("--grpc-port", type=int, default=0, help="gateway gRPC port (0: a free one)")
    p.add_argument("--http-port", type=int, default=0, help="gateway HTTP port (0: a free one)")
    p.add_argument("--auth-token", default=None,
                   help="shared token every gateway request must carry (visible in ps: prefer --auth-token-file or "
                        "the MOONCAKE_API_KEY environment variable)")
    p.add_argument("--auth-token-file", default=None, help="file whose first line is the shared token")
    p.add_argument("--cors-origin", action="append", default=[],
                   help="browser origin allowed to call the HTTP API (repeat for several)")
    p.add_argument("--policy", default="kvcache-centric",
                   choices=["random", "load-balance", "local-cache-aware", "kvcache-centric"])
    p.add_argument("--admission", default="predictive", choices=["none", "baseline", "early", "predictive"])
    p.add_argument("--ttft-slo-s", type=float, default=30.0)
    p.add_argument("--tbt-slo-s", type=float, default=1.0)
    p.add_argument("--prefill-chunk-size", type=int, default=None, help="default: InstanceConfig's (512)")
    p.add_argument("--max-batch", type=int, default=None, help="default: InstanceConfig's (32)")
    p.add_argument("--layerwise", action="store_true", help="layer-wise prefill with the KV pool")
    from ..transfer.messenger import DATA_PLANES  # here, not at import: ``mooncake-jax --help`` stays light

    p.add_argument("--data-plane", default=None, choices=DATA_PLANES,
                   help="how block data moves between instances: auto (default: the socket plane where both ends "
                        "serve it and TLS is off, else gRPC), grpc, jax, socket")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-shape", default=None,
                       help=f"{role} instances' shape, e.g. tensor=2,stage=2 (each gets its own devices)")
        p.add_argument(f"--{role}-dtype", default=None, help=f"{role} instances' dtype (float32, bfloat16)")
        p.add_argument(f"--{role}-block-size", type=int, default=None, help=f"{role} instances' KV page size")
        p.add_argument(f"--{role}-cpus", default=None,
                       help=f"host cores of the {role} instances' own, e.g. 1 or 2-3 (the rest keep off them)")
    p.add_argument("--cluster-file", default=None,
                   help="JSON listing the instances with their configs (instead of --prefill/--decode and shapes)")
    p.add_argument("--in-process", action="store_true", help="run the instances as threads of this process")
    p.add_argument("--coupled", action="store_true",
                   help="no disaggregation: one engine does prefill and decode (the baseline)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or its folder) to use instead of the model's; 'bytes' serves text as raw "
                        "bytes (needed for a model folder without tokenizer.json)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id in /v1/models and responses, which requests name (default: the preset's "
                        "name, or the model folder's name, not its path)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file for /v1/chat/completions (default: the model's own)")
    p.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds open requests get to finish before they are ended")
    p.add_argument("--log-dir", default=None,
                   help="write each instance's log here (default: a new folder per run in the temporary directory)")
    p.add_argument("--no-warmup", action="store_true", help="compile step shapes on first use instead of at start, "
                                                            "and send no warm-up requests through the cluster")
    p.add_argument("--profile-file", type=Path, default=None,
                   help="cost profile JSON (from `mooncake-jax profile`) for every instance (default: each distinct "
                        "engine is measured at start, some seconds per engine)")
    p.add_argument("--compile-cache", default="", help="persistent XLA cache folder ('none' to disable; default: "
                                                          "the user's cache directory)")


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    from ..gateway.auth import resolve_token

    try:
        args.auth_token = resolve_token(args.auth_token, args.auth_token_file, os.environ)
    except ValueError as e:
        print(f"mooncake-jax serve: {e}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.auth_token:
        print("mooncake-jax serve: listening beyond loopback needs --auth-token", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        from ..gateway.tokenizer import check_tokenizer_source
        from .main import settle_serving_process

        check_tokenizer_source(args.model, args.tokenizer)  # before minutes of instance start-up, not after
        service = _coupled(args) if args.coupled else _cluster(args)
    except ValueError as e:
        print(f"mooncake-jax serve: {e}", file=sys.stderr)
        return 2
    with service:
        if not args.coupled and not args.no_warmup:
            service.warm_serving_path()  # channels, pools and thread pools ready before the first client
        try:
            gateway = service.serve_gateway(host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                                            auth_token=args.auth_token, tokenizer=args.tokenizer,
                                            chat_template=args.chat_template, drain_grace_s=args.drain_grace_s,
                                            model_name=args.served_model_name, cors_origins=tuple(args.cors_origin))
        except (ValueError, OSError) as e:
            print(f"mooncake-jax serve: {e}", file=sys.stderr)
            return 2
        for name, address in service.addresses():
            log.info("%-13s %s", name, address)
        log.info("gateway gRPC  %s:%s (mooncake.v1.Gateway, health, reflection)", args.host, gateway.grpc_port)
        log.info("gateway HTTP  http://%s:%s/v1/completions  /v1/chat/completions  /v1/models  /metrics",
                 args.host, gateway.http_port)
        settle_serving_process(carries_tokens=True)
        print(f"READY grpc={gateway.grpc_port} http={gateway.http_port}", flush=True)
        stop.wait()
        log.info("shutting down")
    return 0


def _cluster(args):
    from ..instance.cluster import Cluster

    if args.cluster_file:
        shaped = {"--prefill-chunk-size": args.prefill_chunk_size is not None,
                  "--max-batch": args.max_batch is not None,
                  "--layerwise": args.layerwise,
                  "--data-plane": args.data_plane is not None,
                  **{f"--{r}-{w}": getattr(args, f"{r}_{w.replace('-', '_')}") is not None
                     for r in ("prefill", "decode") for w in ("shape", "dtype", "block-size", "cpus")}}
        if any(shaped.values()):
            given = [flag for flag, set_ in shaped.items() if set_]
            raise ValueError(f"--cluster-file lists every instance's config; drop {given}")
        roles = {}
    else:
        roles = dict(prefill=args.prefill, decode=args.decode, prefill_chunk_size=args.prefill_chunk_size,
                     max_batch=args.max_batch, layerwise=args.layerwise, data_plane=args.data_plane,
                     **{f"{r}_{w}": getattr(args, f"{r}_{w}") for r in ("prefill", "decode")
                        for w in ("shape", "dtype", "block_size", "cpus")})
    return Cluster.local(args.model, processes=not args.in_process, policy=args.policy, admission=args.admission,
                         ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_s, cluster_file=args.cluster_file,
                         profile_json=_profile_json(args.profile_file),
                         log_dir=args.log_dir, host=args.host, warmup=not args.no_warmup, auth_token=args.auth_token,
                         compile_cache=None if args.compile_cache == "none" else args.compile_cache, **roles)


def _profile_json(path: Path | None) -> str | None:
    """The text of ``--profile-file``, checked to be a JSON object before anything starts."""
    if path is None:
        return None
    try:
        text = path.read_text()
        if not isinstance(json.loads(text), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ValueError(f"--profile-file {path}: {e}") from None
    return text


def _coupled(args):
    from ..instance.local_backend import CoupledServer

    sizes = {k: v for k, v in (("prefill_chunk_size", args.prefill_chunk_size), ("max_batch", args.max_batch))
             if v is not None}
    return CoupledServer(args.model, **sizes,
                         warmup=not args.no_warmup,
                         compile_cache=None if args.compile_cache == "none" else args.compile_cache)
