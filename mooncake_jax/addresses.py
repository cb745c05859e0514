"""Network addresses as every role reads and writes them: ``HOST:PORT``, ``[IPv6]:PORT``, a bare host, a gRPC peer.

One reader and one writer, so that a ``--listen`` flag, an advertised address, the address a server binds, a data
plane's offer and the peer gRPC reports agree on what the host and the port of a string are, and on which hosts are
wildcards (bound to every address) or this machine's loopback. An IPv6 host is written in brackets whenever a port
follows it (``[::1]:7000``): without them ``::1:7000`` is itself an IPv6 address.
"""

from __future__ import annotations

import functools
import ipaddress
import socket

WILDCARDS = frozenset({"", "0.0.0.0", "::"})
"""Hosts a server binds to listen on every address of its machine; no peer can connect to one as named."""

LOOPBACK_NAMES = frozenset({"localhost"})

_PEER_SCHEMES = ("ipv4:", "ipv6:")  # gRPC's context.peer(): "ipv4:10.0.0.2:5123", "ipv6:[::1]:5123"


def split(address: str) -> tuple[str, str]:
    """(host without brackets, port text or ``""``) of ``HOST:PORT``, ``[IPv6]:PORT``, ``[IPv6]``, ``HOST``, a bare
    IPv6 address (no port: its colons are the address's) or a gRPC peer string. The port is not checked here."""
    text = address.strip()
    for scheme in _PEER_SCHEMES:
        if text.startswith(scheme):
            text = text[len(scheme):]
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            return text[1:], ""
        rest = text[close + 1:]
        return text[1:close], rest[1:] if rest.startswith(":") else ""
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    return text, ""


def join(host: str, port: int | str) -> str:
    """``HOST:PORT``, the host in brackets when it is an IPv6 address."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_of(address: str) -> str:
    """The host of any address ``split`` reads, without brackets."""
    return split(address)[0]


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback as written: a loopback IP address or ``localhost``. A name is not
    looked up (for deciding what a listening server may skip, e.g. a token on loopback, the name must say it)."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=256)
def resolves_to_loopback(host: str) -> bool:
    """Whether every address ``host`` names is this machine's loopback (a name is looked up; one that does not
    resolve is not loopback). Cached: asked on every block move, and a lookup is not free."""
    if is_loopback(host):
        return True
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host.strip("[]"), None))
    except (OSError, ValueError):
        return False
