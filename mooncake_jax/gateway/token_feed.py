"""Generated tokens sent straight from a decode instance's engine thread to the gateway's event loop.

Why: on the gRPC stream a token wakes five threads in three processes before the client has it (the decode's
gRPC handler, its server's poller, the gateway's stream reader, its event loop, the client); each can wait for a
core behind other work, and the demo's longest token gaps are those waits (docs/benchmarks/demo.md, twentieth
session). Here the engine thread sends each token, as it is generated, as one UDP datagram to the gateway, whose
event loop reads it itself: two wake-ups. A prototype of this path brought the demo's TBT p99 from 5.75 to 4.61
decode steps at the median of six alternated pairs.

The gRPC stream stays the authority: it still carries every token (in batches, ``decode.FEED_BATCH_INTERVAL_S``
apart, so that it no longer wakes its threads for each), acceptance, the end and errors, and the gateway's
``stream.TokenMerge`` takes each token from whichever way brings it first. A lost datagram costs that token, and the
ones after it, the wait for the next batch; an address the decode instance cannot reach, every token's (so a feed
on loopback goes only to instances on this machine: ``reaches``). A datagram is ``b"<request id> <index> <token>"``
(ASCII); the gateway drops any it cannot read or that names no request it is serving. The request id is the only
credential, so a gateway sends its feed's address only where the instances are reached without TLS or a token
(``Cluster.serve_gateway``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable

from ..addresses import host_of, is_loopback, join, resolves_to_loopback, split
from .backend import TokenOut

log = logging.getLogger(__name__)


def reaches(feed_address: str, instance_address: str) -> bool:
    """Whether an instance at ``instance_address`` can send to a feed at ``feed_address``: always, unless the feed
    listens on loopback and the instance is not on this machine (its datagrams would go to its own loopback, and its
    tokens would reach the gateway only in the stream's batches)."""
    return not is_loopback(host_of(feed_address)) or resolves_to_loopback(host_of(instance_address))


def encode(request_id: bytes, index: int, token: int) -> bytes:
    return b"%s %d %d" % (request_id, index, token)


def decode(datagram: bytes) -> tuple[str, int, int] | None:
    """``(request id, index, token)``, or None for a datagram that is not one."""
    parts = datagram.split()
    if len(parts) != 3:
        return None
    try:
        return parts[0].decode("ascii"), int(parts[1]), int(parts[2])
    except (UnicodeDecodeError, ValueError):
        return None


class FeedSender:
    """The decode side: one request's tokens, sent from the engine thread to ``address`` (``HOST:PORT``). Never
    blocks and never raises: a datagram that cannot be sent is left to the gRPC stream."""

    _sockets: dict[int, socket.socket] = {}  # one per address family, shared by every request of the process
    _lock = threading.Lock()

    def __init__(self, address: str, request_id: str):
        """ValueError for an address that is not ``HOST:PORT``, or a request id that is not ASCII."""
        host, port = split(address)
        self._target = (host, int(port))
        self._request_id = request_id.encode("ascii")
        if b" " in self._request_id:
            raise ValueError("a request id sent on the token feed cannot hold spaces")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with FeedSender._lock:
            sock = FeedSender._sockets.get(family)
            if sock is None:
                sock = FeedSender._sockets[family] = socket.socket(family, socket.SOCK_DGRAM)
                sock.setblocking(False)
        self._sock = sock

    def send(self, index: int, token: int) -> None:
        try:
            self._sock.sendto(encode(self._request_id, index, token), self._target)
        except OSError:
            pass


class FeedReceiver:
    """The gateway side: a UDP socket read by one event loop, handing each datagram's token to the sink registered
    for its request (``register``; called on the loop's thread)."""

    def __init__(self, host: str):
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self._sock.bind((host.strip("[]"), 0))
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self.address = join(host, self._sock.getsockname()[1])
        self._sinks: dict[str, Callable[[TokenOut], object]] = {}
        self._lock = threading.Lock()
        self.received = 0  # tokens handed to a request's sink (whether or not the stream had brought them first)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read datagrams on ``loop`` (call on its thread)."""
        loop.add_reader(self._sock.fileno(), self._read)

    def register(self, request_id: str, sink: Callable[[TokenOut], object]) -> None:
        with self._lock:
            self._sinks[request_id] = sink

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)

    def _read(self) -> None:
        while True:
            try:
                datagram = self._sock.recv(512)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed
                return
            parsed = decode(datagram)
            if parsed is None:
                continue
            request_id, index, token = parsed
            with self._lock:
                sink = self._sinks.get(request_id)
            if sink is not None:
                self.received += 1
                try:
                    sink(TokenOut(token, index, 0.0))
                except Exception:  # noqa: BLE001 - the gRPC stream still brings this token; the loop keeps serving
                    log.exception("token feed: a sink failed")

    def close(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._sock.fileno())
            except (ValueError, RuntimeError, OSError):
                pass
        self._sock.close()
