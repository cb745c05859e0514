"""A socket data plane for the Messenger: block records over a plain TCP connection, gRPC kept for control.

Why: a Python receiver on grpcio pays two user-space copies of every message (grpcio's slices made ``bytes``, then
joined) before it can even hash a record, in C where the hash cannot be folded in (issue 15, fourteenth pass). Over
a plain socket the sender hands the kernel views of its records as stored (``sendmsg``: no join, no copy in user
space) and the receiver ``recv_into``s them straight into a reused staging buffer of about an L2's worth of whole
records, which the pool then copies into its slots, hashing each record from cache as it goes
(``BlockPool.put_records``): the kernel's copy and the store's, nothing else.

Control stays on gRPC (``OfferPull`` / ``PullFrom``, as for the device plane): the offering process registers the
records of an offer under a random 128-bit pull token and tells the peer (over the authenticated control call)
where to connect; the puller connects, presents the token, and reads ``HEADER`` then the records back to back. The
token is the capability: single use (taken from the table when a pull presents it), and gone after the control
call's deadline (an offer never pulled is reaped, its pins released); an unknown, spent or expired token is
answered with an error status and a message, never a hang. Every read and write has a timeout, and the whole pull
ends by the call's deadline.

One plane per listening host in a process (``socket_plane(host, advertise)``): one listening socket on the host
the Messenger's gRPC server listens on (an instance's ``InstanceConfig.host``; loopback for a process that only runs
clients), one thread accepting (and reaping expired offers), a thread per connection serving it. An offer carries
the address peers reach the plane at: the advertised host (``InstanceConfig.advertise``) when there is one, else the
bound host; a wildcard bind (0.0.0.0, ::) with nothing advertised is sent as such and the puller connects to the host
it reaches the offering peer's gRPC at instead (``resolve``), so an offer never sends a peer to its own loopback or
to 0.0.0.0. A plane bound to loopback is not offered to a peer on another host (``reachable_from``): the Messenger
then keeps gRPC for that peer.

TLS: not supported; a process with TLS configured (``proto/tls.py``) refuses ``data_plane="socket"`` with a
ValueError instead of moving blocks in clear text, and ``data_plane="auto"`` keeps gRPC there.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from mooncake_jax.addresses import is_wildcard, join, resolves_to_loopback, split
from mooncake_jax.proto import tls
from mooncake_jax.transfer.plane_registry import PlaneRegistry

log = logging.getLogger(__name__)

MAGIC = b"MJS1"
"""What a puller sends first (then its token): a stray connection is closed without a word."""
TOKEN_BYTES = 16
HEADER = struct.Struct("<BxxxIQQ")
"""The offering side's answer: status (0: records follow), message length (status != 0: that many bytes of UTF-8
explanation follow instead), record count, bytes per record."""
OK, REFUSED = 0, 1
STAGE_BYTES = 1 << 20
"""Whole records received before they are stored (at least one record): the staging buffer is still in the core's
L2 (2 MiB on the machines measured) when the pool's copy-and-hash reads it."""
IO_TIMEOUT_S = 30.0
"""Longest wait for any one read or write on a data connection (the call's deadline cuts it shorter)."""
CONNECT_TIMEOUT_S = 10.0
CONNECT_SHARE = 0.5
"""Most of a pull's remaining deadline its connect may take (and at most ``CONNECT_TIMEOUT_S``): a data port that
drops packets (a firewall) is found out with the rest of the deadline left, in which a ``data_plane="auto"`` move
goes on over gRPC instead of failing at its deadline."""
HELLO_TIMEOUT_S = 10.0
"""Longest wait for a connection's magic and token."""
SEND_BUFFERS = 512
"""Views handed to one ``sendmsg`` (under the kernel's IOV_MAX of 1024)."""
REAP_EVERY_S = 0.5


class PullError(RuntimeError):
    """A pull failed on the link: refused (unknown, spent or expired token), the peer gone, a timeout. ``received``
    counts the whole records that had arrived (and were handed to the store) before the failure; ``connected`` is
    False when the offering plane could not be reached at all (nothing was asked or sent: the move can go another
    way, which ``data_plane="auto"`` does)."""

    def __init__(self, message: str, received: int = 0, connected: bool = True) -> None:
        super().__init__(message)
        self.received = received
        self.connected = connected


def resolve(address: str, peer_host: str | None) -> str:
    """An offer's ``HOST:PORT`` as this end connects to it: a wildcard host (an offering plane bound to every
    address, nothing advertised) is the host this end reaches the offering peer's gRPC at."""
    host, port = split(address)
    if is_wildcard(host) and peer_host:
        return join(peer_host, port)
    return address


def refuse_tls() -> None:
    """ValueError if this process speaks TLS: the socket plane would move blocks in clear text."""
    if tls.files() is not None:
        raise ValueError('data_plane="socket" does not support TLS (the records would travel in clear text): '
                         'use data_plane="grpc" with --tls-cert / --tls-key')


@dataclasses.dataclass
class _Offer:
    records: Sequence[bytes | memoryview]
    record_bytes: int
    deadline: float
    release: Callable[[], None] | None

    def done(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            try:
                release()
            except Exception:  # a failed release must not kill the serving thread
                log.exception("socket plane: releasing an offer failed")


class SocketPlane:
    """This process's listening socket, the offers it serves, and pulls from peers' planes."""

    def __init__(self, host: str = "127.0.0.1", advertise: str | None = None) -> None:
        self.host = host
        self.advertise = advertise or None
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._offers: dict[bytes, _Offer] = {}
        self._local = threading.local()
        self.tamper: Callable[[int, bytes | memoryview], bytes | memoryview | None] | None = None
        """Test hook on the sending side: given record i of a pull and its bytes, what to send instead (a damaged
        copy), or None to close the connection there (a peer that dies mid-stream)."""

    # ---- the offering side ----------------------------------------------------------------------------------

    def _started(self) -> socket.socket:
        with self._lock:
            if self._listener is None:
                listener = socket.create_server((self.host, 0), backlog=64)
                listener.settimeout(REAP_EVERY_S)
                self._listener = listener
                threading.Thread(target=self._accept, args=(listener,), name="socket-plane-accept",
                                 daemon=True).start()
            return self._listener

    @property
    def address(self) -> str:
        """Where peers connect to pull what this process offers (``host:port``: the advertised host, else the bound
        one; a wildcard is resolved by the puller, ``resolve``)."""
        host, port = self._started().getsockname()[:2]
        host = self.advertise or host
        return join(host, port)

    def reachable_from(self, peer_host: str | None) -> bool:
        """Whether a peer at ``peer_host`` can connect to this plane: not when its offers name a loopback host
        (the bound one, nothing else advertised) and the peer is on another host."""
        named = self.advertise or self.host
        if is_wildcard(named) or not peer_host or not resolves_to_loopback(named):
            return True
        return resolves_to_loopback(peer_host)

    @property
    def offers(self) -> int:
        """Offers registered and not yet pulled or reaped."""
        with self._lock:
            return len(self._offers)

    def offer(self, records: Sequence[bytes | memoryview], timeout_s: float,
              release: Callable[[], None] | None = None) -> tuple[str, bytes]:
        """Register ``records`` (one length each; kept as given and sent as they are, so they must not change until
        the pull is over: the caller pins their blocks) for one pull within ``timeout_s``; ``(address, token)``.
        ``release`` is called once when the pull has ended or the offer expired unpulled."""
        if not records:
            raise ValueError("an offer needs at least one record")
        size = len(records[0])
        if any(len(record) != size for record in records):
            raise ValueError("the records of an offer must all have one length")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        address = self.address
        token = os.urandom(TOKEN_BYTES)
        with self._lock:
            self._offers[token] = _Offer(records, size, time.monotonic() + timeout_s, release)
        return address, token

    def withdraw(self, token: bytes) -> None:
        """Drop an offer not pulled (its call failed); nothing if it was pulled or has expired."""
        with self._lock:
            offer = self._offers.pop(token, None)
        if offer is not None:
            offer.done()

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [token for token, offer in self._offers.items() if offer.deadline <= now]
            offers = [self._offers.pop(token) for token in expired]
        for offer in offers:
            offer.done()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                self._reap()
                continue
            except OSError as err:
                if err.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed
                log.warning("socket plane: accept failed: %s", err)
                time.sleep(0.05)
                continue
            self._reap()
            threading.Thread(target=self._serve, args=(conn,), name="socket-plane-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        try:
            conn.settimeout(IO_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello_by = time.monotonic() + HELLO_TIMEOUT_S
            if _recv_exactly(conn, len(MAGIC), hello_by) != MAGIC:
                return  # not a puller: closed without a word
            token = _recv_exactly(conn, TOKEN_BYTES, hello_by)
            with self._lock:
                offer = self._offers.pop(token, None)
            if offer is None or offer.deadline <= time.monotonic():
                why = (f"pull token {token.hex()} is unknown, already pulled, or expired "
                       f"(an offer is good for one pull within its call's deadline)").encode()
                conn.sendall(HEADER.pack(REFUSED, len(why), 0, 0) + why)
                return
            conn.sendall(HEADER.pack(OK, 0, len(offer.records), offer.record_bytes))
            self._send(conn, offer)
        except (OSError, PullError) as err:  # the puller went away or timed out: it reports the failure
            log.debug("socket plane: a pull ended early: %s", err)
        finally:
            if offer is not None:
                offer.done()
            conn.close()

    def _send(self, conn: socket.socket, offer: _Offer) -> None:
        """The offer's records, as they lie, ``SEND_BUFFERS`` views to a ``sendmsg``, by the offer's deadline."""
        records = offer.records
        tamper = self.tamper
        for start in range(0, len(records), SEND_BUFFERS):
            batch = [memoryview(record).cast("B") for record in records[start : start + SEND_BUFFERS]]
            if tamper is not None:
                changed = []
                for i, record in enumerate(batch, start):
                    sent = tamper(i, record)
                    if sent is None:
                        _send_all(conn, changed, offer.deadline)
                        return  # a peer dying mid-stream: the connection closes here
                    changed.append(memoryview(sent).cast("B"))
                batch = changed
            _send_all(conn, batch, offer.deadline)

    # ---- the pulling side -----------------------------------------------------------------------------------

    def _stage(self, n_bytes: int) -> memoryview:
        """This thread's reused staging buffer, at least ``n_bytes`` (its pages stay mapped and warm)."""
        stage = getattr(self._local, "stage", None)
        if stage is None or len(stage) < n_bytes:
            stage = self._local.stage = np.empty(n_bytes, np.uint8)
        return memoryview(stage)[:n_bytes]

    def pull(self, address: str, token: bytes, count: int, record_bytes: int,
             store: Callable[[int, list[memoryview]], None], timeout_s: float, peer_host: str | None = None) -> None:
        """Pull the ``count`` records of ``record_bytes`` offered at ``address`` under ``token``, handing them to
        ``store(first, records)`` (record ``first`` onward, views of the staging buffer valid only during the call)
        in batches of whole records as they arrive. PullError for a refused token or a link failure (after storing
        the whole records that had arrived), whatever ``store`` raises as it is; all by ``timeout_s``.
        ``peer_host``: the host this end reaches the offering peer's gRPC at (resolves a wildcard offer; an offer on
        loopback from a peer on another host is refused unconnected, never tried on this host's loopback)."""
        deadline = time.monotonic() + timeout_s
        address = resolve(address, peer_host)
        host, port = split(address)
        if not host or not port.isdigit() or len(token) != TOKEN_BYTES:
            raise PullError(f"socket plane: bad offer (address {address!r}, token of {len(token)} bytes)",
                            connected=False)
        if peer_host and resolves_to_loopback(host) and not resolves_to_loopback(peer_host):
            raise PullError(f"socket plane: the peer at {peer_host} offered on {address}, its own loopback, which "
                            f"this host cannot reach (give that peer a reachable host or --advertise)",
                            connected=False)
        try:
            conn = socket.create_connection((host, int(port)),
                                            timeout=max(min(CONNECT_TIMEOUT_S,
                                                                CONNECT_SHARE * (deadline - time.monotonic())), 0.001))
        except OSError as err:
            raise PullError(f"socket plane: cannot connect to {address}: {err}", connected=False) from err
        received = 0
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IO_TIMEOUT_S)
            conn.sendall(MAGIC + token)
            status, why_bytes, n, size = HEADER.unpack(_recv_exactly(conn, HEADER.size, deadline))
            if status != OK:
                why = _recv_exactly(conn, min(why_bytes, 4096), deadline).decode(errors="replace")
                raise PullError(f"socket plane: {address} refused the pull: {why}")
            if n != count or size != record_bytes:
                raise PullError(f"socket plane: {address} offers {n} records of {size} bytes, "
                                f"expected {count} of {record_bytes}")
            per_stage = max(1, STAGE_BYTES // record_bytes)
            stage = self._stage(min(per_stage, count) * record_bytes)
            while received < count:
                k = min(per_stage, count - received)
                view = stage[: k * record_bytes]
                try:
                    _recv_into_exactly(conn, view, deadline)
                except PullError as err:  # the whole records that made it are stored, then the failure told
                    whole = err.received // record_bytes
                    if whole:
                        store(received, [view[i * record_bytes : (i + 1) * record_bytes] for i in range(whole)])
                    raise PullError(f"socket plane: pull from {address}: {err} after {received + whole} of "
                                    f"{count} records", received + whole) from None
                store(received, [view[i * record_bytes : (i + 1) * record_bytes] for i in range(k)])
                received += k
        except OSError as err:
            raise PullError(f"socket plane: pull from {address}: {err}", received) from err
        finally:
            conn.close()


def _timeout(conn: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the call's deadline passed")
    conn.settimeout(min(IO_TIMEOUT_S, remaining))


def _recv_into_exactly(conn: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``conn``; PullError (``received``: bytes that landed) if the peer closes or a timeout
    or the deadline passes first."""
    got, n = 0, len(view)
    while got < n:
        try:
            _timeout(conn, deadline)
            m = conn.recv_into(view[got:], n - got)
        except TimeoutError as err:
            raise PullError(f"timed out ({err or 'no data for ' + str(conn.gettimeout()) + ' s'})", got) from None
        except OSError as err:
            raise PullError(f"connection failed ({err})", got) from None
        if not m:
            raise PullError("the peer closed the connection mid-stream", got)
        got += m


def _recv_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    buffer = bytearray(n)
    _recv_into_exactly(conn, memoryview(buffer), deadline)
    return bytes(buffer)


def _send_all(conn: socket.socket, views: list[memoryview], deadline: float) -> None:
    """Send ``views`` in order with ``sendmsg`` (no join), going on after a partial send."""
    first = 0
    while first < len(views):
        _timeout(conn, deadline)
        sent = conn.sendmsg(views[first : first + SEND_BUFFERS])
        while first < len(views) and sent >= len(views[first]):
            sent -= len(views[first])
            first += 1
        if sent:
            views[first] = views[first][sent:]


_PLANES: PlaneRegistry[SocketPlane] = PlaneRegistry(SocketPlane)


def socket_plane(host: str | None = None, advertise: str | None = None) -> SocketPlane:
    """This process's ``SocketPlane`` listening (on first use) on ``host`` (by default loopback; an instance passes
    the host its gRPC server listens on) and offering at ``advertise`` (None: the bound host): one per such pair."""
    return _PLANES(host or "127.0.0.1", advertise or None)
