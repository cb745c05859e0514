"""The shared-token gate of both front ends, and the rule that keeps an open gateway off the network.

A gateway listening beyond loopback without a token would let anyone on the network generate (and fill the
cluster's KV), so ``check_exposure`` refuses that unless the caller says it is intended.
"""

from __future__ import annotations

from mooncake_jax.proto.auth import is_loopback


def check_exposure(host: str, token: str | None, allow_unauthenticated: bool) -> None:
    if token is None and not is_loopback(host) and not allow_unauthenticated:
        raise ValueError(f"refusing to listen on {host!r} without an auth_token: anyone who can reach it could "
                         f"generate; give a token, listen on 127.0.0.1, or pass allow_unauthenticated=True")
    if token is not None and not token.strip():
        raise ValueError("auth_token must not be empty")
