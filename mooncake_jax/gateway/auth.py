"""The shared-token gate of both front ends, and the rule that keeps an open gateway off the network.

A gateway listening beyond loopback without a token would let anyone on the network generate (and fill the
cluster's KV), so ``check_exposure`` refuses that unless the caller says it is intended.
"""

from __future__ import annotations

import hmac
import ipaddress

LOOPBACK_NAMES = ("localhost",)


def bearer_ok(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` value carries ``token`` (always true without a token); constant-time."""
    if token is None:
        return True
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None, allow_unauthenticated: bool) -> None:
    if token is None and not is_loopback(host) and not allow_unauthenticated:
        raise ValueError(f"refusing to listen on {host!r} without an auth_token: anyone who can reach it could "
                         f"generate; give a token, listen on 127.0.0.1, or pass allow_unauthenticated=True")
    if token is not None and not token.strip():
        raise ValueError("auth_token must not be empty")
