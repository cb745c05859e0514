"""Messenger: the per-instance gRPC service and client that move KVCache blocks between pools.

The paper moves blocks with GPUDirect RDMA; gRPC streaming is the portable data plane here, behind an interface
(fetch by keys, push by keys) that a device-native path could implement too. Both directions skip the blocks
the receiver already holds (a fetch asks only for what its pool lacks, a push first asks the peer). A block
travels as the record its pool stores, one message when it fits under the message limit, else in pieces
(``pieces.py``), and is verified once, whole, before the receiver stores it, so a transfer that dies midway
leaves only whole, checked blocks behind, each announced by the pool's STORED event. Every call has a deadline.
Both ends keep several blocks in flight (``readahead.py``): the sender reads records from its pool and joins small
ones several to a message ahead of the transport (``outgoing.py``), the receiver takes messages from gRPC ahead of
storing them, so block i is stored while i+1 arrives.

Which plane carries the block data (``DATA_PLANES``): by default ("auto") the socket plane (``socket_plane.py``:
records sent as they lie with ``sendmsg``, pulled into a staging buffer, gRPC only for control) whenever the peer
lists it in ``HasReply.data_planes`` and this process has no TLS, else the gRPC streams above; a socket step the
peer refuses before anything of it moved (an older build, a peer configured "grpc", a data port it cannot reach)
sends the rest of the move over gRPC and keeps gRPC with that peer, said once in the log.

Server side, ``MessengerServer(pool).start()`` (``messenger_server.py``); client side,
``MessengerClient(address, pool)``: ``fetch(keys)`` for on-demand loads, ``push(keys)`` for transfers the
Conductor schedules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc
import numpy as np

from mooncake_jax.addresses import host_of
from mooncake_jax.blocks import BlockKey
from mooncake_jax.proto import tls
from mooncake_jax.proto.auth import open_channel
from mooncake_jax.transfer.counters import Meter, TransferCounters
from mooncake_jax.transfer.device_plane import device_plane, groups
from mooncake_jax.transfer.frame import PREFIX_BYTES, CorruptBlockError, check_key
from mooncake_jax.transfer.frame import decode as decode_record
from mooncake_jax.transfer.spec import BlockSpec
from mooncake_jax.transfer.messenger_server import MessengerServer
from mooncake_jax.transfer.messenger_wire import (
    CORRUPT_KEYS_METADATA,
    MISSING_KEYS_METADATA,
    SERVICE,
    describe_keys,
    messages,
    services,
)
from mooncake_jax.transfer.outgoing import Outgoing
from mooncake_jax.transfer.pieces import (
    BATCH_BYTES,
    PIECE_BYTES,
    RecordAssembler,
    encode_piece,
    parse_piece,
)
from mooncake_jax.transfer.pool import BlockPool, PoolFullError
from mooncake_jax.transfer.readahead import Ahead
from mooncake_jax.transfer.socket_plane import PullError, refuse_tls, socket_plane

log = logging.getLogger(__name__)

__all__ = [
    "BlocksNotFoundError",
    "MessengerClient",
    "MessengerServer",
    "TransferError",
    "TransferResult",
    "messages",
    "services",
]


class TransferError(RuntimeError):
    """A transfer failed. ``code`` is the gRPC status (None for a local failure); ``stored`` lists the blocks
    that had arrived whole and verified before the failure and are in the receiving pool."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, stored: Sequence[BlockKey] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.stored = list(stored)


class BlocksNotFoundError(TransferError):
    """The sending pool lacks ``keys`` (NOT_FOUND from a peer, or a local pool asked to push what it lacks)."""

    def __init__(self, message: str, keys: Sequence[BlockKey], code=None, stored: Sequence[BlockKey] = ()) -> None:
        super().__init__(message, code, stored)
        self.keys = list(keys)


@dataclasses.dataclass
class TransferResult:
    """What one fetch or push moved: ``moved`` blocks now in the receiving pool, ``skipped`` ones it had."""

    moved: list[BlockKey]
    skipped: list[BlockKey]
    bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds else 0.0


def _unique(keys: Iterable[BlockKey]) -> list[BlockKey]:
    return list(dict.fromkeys(check_key(key) for key in keys))


DATA_PLANES = ("auto", "grpc", "jax", "socket")
"""How block data moves: "auto" (the default): on the socket plane where both ends serve it and this process has no
TLS, else streamed over gRPC; "grpc": streamed over gRPC (portable); "jax": as device arrays pulled with
``jax.experimental.transfer`` (``device_plane.py``); "socket": over a plain TCP connection straight from the stored
records into the receiver's staging buffer (``socket_plane.py``; not with TLS), an error where the peer does not
serve it. With "jax" and "socket" gRPC carries only the control calls."""

_FALLBACK_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)
"""A socket-plane control call refused with these moved nothing (the plane not served, TLS, a data port the peer
could not reach, an older build): "auto" moves the blocks over gRPC instead."""


class _SocketUnusable(Exception):
    """Raised by the socket-plane paths of an "auto" client when the plane cannot be used with the peer and nothing
    of the failed step moved: the rest of the move goes over gRPC."""


class MessengerClient:
    """Moves blocks between ``pool`` and the Messenger at ``address``; every call has a deadline.

    ``data_plane`` picks how block data moves (``DATA_PLANES``); keys, checks and results are the same either way.
    ``data_host`` / ``data_advertise``: where this process's socket plane listens for the peer to pull what it
    pushes, and the host its offers name (an instance passes its own ``host`` and advertised host; None: loopback,
    which "auto" uses only with a peer on this host).
    """

    def __init__(self, address: str, pool: BlockPool, *, timeout_s: float = 60.0,
                 auth_token: str | None = None, data_plane: str = "auto", data_host: str | None = None,
                 data_advertise: str | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES)}, got {data_plane!r}")
        if data_plane == "socket":
            refuse_tls()
        self.data_plane = data_plane
        self.data_host, self.data_advertise = data_host, data_advertise
        self._peer_planes: tuple[str, ...] | None = None  # the peer's HasReply.data_planes, once asked ("auto")
        self._socket_off: str | None = None  # why "auto" keeps gRPC with this peer after a refused socket move
        self._said: set[str] = set()  # fallback reasons logged (once each)
        self.address = address
        self.pool = pool
        self.timeout_s = timeout_s
        self._meter = Meter()
        self._channel = open_channel(address, auth_token)
        self._stub = services.MessengerStub(self._channel)
        # Fetch, Push (and Probe) with pieces as raw bytes, encoded and parsed by pieces.py
        self._fetch_raw = self._channel.unary_stream(
            f"/{SERVICE}/Fetch", request_serializer=messages.FetchRequest.SerializeToString
        )
        self._probe_raw = self._channel.unary_stream(
            f"/{SERVICE}/Probe", request_serializer=messages.ProbeRequest.SerializeToString
        )
        self._push_raw = self._channel.stream_unary(
            f"/{SERVICE}/Push", request_serializer=None, response_deserializer=messages.PushReply.FromString
        )
        self._probe_upload_raw, self._probe_upload_parsed = (self._channel.stream_unary(
            f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=messages.PushReply.FromString
        ) for method in ("ProbeUpload", "ProbeUploadParsed"))

    @property
    def counters(self) -> TransferCounters:
        return self._meter.snapshot()

    def has(self, keys: Iterable[BlockKey], *, timeout_s: float | None = None) -> list[bool]:
        """Which of ``keys`` the peer holds."""
        return list(self._has(keys, timeout_s).present)

    def _has(self, keys: Iterable[BlockKey], timeout_s: float | None):
        """The peer's ``HasReply`` for ``keys`` (which it holds, and how large a message of several pieces it
        takes)."""
        keys = [check_key(key) for key in keys]
        request = messages.HasRequest(keys=keys, spec_fingerprint=self.pool.spec.fingerprint)
        try:
            reply = self._stub.Has(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as err:
            raise self._error("has", err) from err
        self._peer_planes = tuple(reply.data_planes)
        return reply

    def plane(self, pushing: bool = False, deadline: float | None = None) -> str:
        """The plane the next fetch (or push, ``pushing``) takes: the configured one, or for "auto" the socket plane
        when this process and the peer can both use it, else "grpc" (the reason logged once). "auto" asks the peer
        what it serves once (``Has``; a push's own ``Has`` answers it anew each time)."""
        if self.data_plane != "auto":
            return self.data_plane
        why = self._why_not_socket(pushing, deadline)
        if why is None:
            return "socket"
        if why not in self._said:
            self._said.add(why)
            log.info("Messenger to %s: moving blocks over gRPC, not the socket data plane: %s", self.address, why)
        return "grpc"

    def _why_not_socket(self, pushing: bool, deadline: float | None) -> str | None:
        if tls.files() is not None:
            return "TLS is configured (the socket plane would move the blocks in clear text)"
        if self._socket_off is not None:
            return self._socket_off
        if self._peer_planes is None:
            timeout = self.timeout_s if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:  # an empty Has: which planes the peer serves to this caller
                self._peer_planes = tuple(self._stub.Has(messages.HasRequest(
                    keys=[], spec_fingerprint=self.pool.spec.fingerprint), timeout=timeout).data_planes)
            except grpc.RpcError as err:
                if err.code() not in _FALLBACK_CODES:
                    raise self._error("fetch", err) from err
                return f"the peer did not say which planes it serves ({err.code().name})"  # asked again next time
        if "socket" not in self._peer_planes:
            return (f"the peer does not serve it (it serves {', '.join(self._peer_planes) or 'gRPC only'}: an older "
                    f"build, a peer configured data_plane=\"grpc\" or with TLS, or one that cannot reach this host)")
        if pushing and not socket_plane(self.data_host, self.data_advertise).reachable_from(host_of(self.address)):
            return (f"this process's socket plane listens on {self.data_host or '127.0.0.1'}, which the peer at "
                    f"{host_of(self.address)} cannot reach (give the client data_host)")
        return None

    def _socket_refused(self, why: str) -> None:
        """A socket-plane step of an "auto" move was refused before anything moved: gRPC with this peer from now on."""
        self._socket_off = f"a socket-plane move was refused: {why}"

    def fetch(self, keys: Iterable[BlockKey], *, timeout_s: float | None = None) -> TransferResult:
        """Copy the blocks of ``keys`` that this pool lacks from the peer into it.

        Each block is stored as soon as it has arrived whole and verified; they are not pinned, so a caller that
        needs them to stay until it uses them holds ``pool.pin(keys)`` around the fetch and the use. Raises
        BlocksNotFoundError (nothing sent) if the peer lacks any, TransferError on any other failure.

        The check is end to end, as a push's: the peer sends its records as stored, unchecked there, and each is
        hashed as it lands here (an older peer checks them anyway). From a record that fails (or a message that
        cannot be read) the blocks not yet stored are asked for once more, checked by the peer this time: one
        damaged there is dropped there and reported as BlocksNotFoundError naming it (``stored``: the blocks before
        it), as a block found damaged before sending always was; one damaged on the way arrives sound.
        """
        keys = _unique(keys)
        wanted = [key for key in keys if key not in self.pool]
        wanted_set = set(wanted)
        skipped = [key for key in keys if key not in wanted_set]
        started = time.perf_counter()
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        stored: list[BlockKey] = []
        plane = self.plane(deadline=deadline) if wanted else self.data_plane
        plane, rest = self._socket_first(plane, wanted, stored,
                                         lambda: self._fetch_socket_checked(wanted, deadline, started, stored))
        if rest and plane == "jax":
            self._fetch_pulled(rest, started, deadline, stored)
        elif rest:
            # the peer sends the records as stored and this end checks each as it lands; from a record that fails,
            # the rest are asked for again, checked by the peer this time: damaged there, it is dropped there and
            # named NOT_FOUND (BlocksNotFoundError); damaged on the way, it arrives sound the second time
            expected = set(rest)
            if self._fetch_streamed(rest, expected, deadline, started, stored, receiver_checks=True):
                self._meter.add(blocks_refused=1)
                arrived = set(stored)
                self._fetch_streamed([key for key in rest if key not in arrived], expected, deadline, started,
                                     stored, receiver_checks=False)
        received = len(stored) * self.pool.frame_bytes
        if len(stored) != len(wanted):  # not expected on the planes that pull: every failure there raises
            self._failed(received, len(stored), started)
            message = f"fetch from {self.address}: peer sent {len(stored)} of {len(wanted)} blocks"
            raise TransferError(message, stored=stored)
        seconds = time.perf_counter() - started
        self._meter.add(transfers=1, blocks_received=len(stored), bytes_received=received, busy_s=seconds)
        self._meter.add(blocks_skipped=len(skipped))
        return TransferResult(stored, skipped, received, seconds)

    def _fetch_streamed(self, keys: list[BlockKey], expected: set[BlockKey], deadline: float, started: float,
                        stored: list[BlockKey], receiver_checks: bool) -> bool:
        """One Fetch call for ``keys``, storing each record as it arrives (appended to ``stored``). With
        ``receiver_checks`` the peer sends the records unchecked (``FetchRequest.receiver_checks``), and a record
        that fails its check here, or a message that cannot be read, ends the call: True (nothing after the blocks
        in ``stored`` kept). Else such a failure is a TransferError, as is any other (BlocksNotFoundError for a
        NOT_FOUND)."""
        request = messages.FetchRequest(keys=keys, spec_fingerprint=self.pool.spec.fingerprint,
                                        batch_bytes=BATCH_BYTES, receiver_checks=receiver_checks)
        call = self._fetch_raw(request, timeout=max(deadline - time.monotonic(), 0.001))
        arriving = Ahead(call, name="receive-ahead", join=False)  # block i is stored while i+1 arrives
        new: list[bool] = []
        try:
            for records in _records_of(arriving, self.pool.spec, expected):
                try:  # a message's records in one pool call
                    self.pool.put_records(records, new)
                finally:
                    stored.extend(key for key, _ in records[: len(new)])
                    new.clear()
        except grpc.RpcError as err:
            self._failed(len(stored) * self.pool.frame_bytes, len(stored), started)
            raise self._error("fetch", err, stored) from err
        except (TransferError, ValueError) as err:  # a record failing its check is a CorruptBlockError (ValueError)
            if receiver_checks:
                return True
            self._failed(len(stored) * self.pool.frame_bytes, len(stored), started)
            raise TransferError(f"fetch from {self.address}: {err}", stored=stored) from err
        except PoolFullError as err:
            self._failed(len(stored) * self.pool.frame_bytes, len(stored), started)
            raise TransferError(f"fetch from {self.address}: {err}", stored=stored) from err
        finally:
            call.cancel()  # nothing once the call is over; else the receiving thread stops at once
            arriving.close()
        return False

    def same_spec(self, *, timeout_s: float | None = None) -> bool:
        """Whether the peer's pool holds blocks of this pool's spec (so ``push`` and ``fetch`` can move them);
        False when it holds another layout (then the peer fetches with ``fetch_blocks`` and converts)."""
        try:
            self._stub.Has(messages.HasRequest(keys=[], spec_fingerprint=self.pool.spec.fingerprint),
                           timeout=timeout_s or self.timeout_s)
            return True
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return False
            raise self._error("has", err) from err

    def fetch_blocks(self, keys: Sequence[BlockKey], spec: BlockSpec, *,
                     timeout_s: float | None = None) -> list[np.ndarray]:
        """The blocks of ``keys`` from a peer whose pool holds ``spec`` (another layout than this pool's), each
        verified, as arrays in the order asked; this pool is not touched. BlocksNotFoundError if the peer lacks
        any, TransferError on any other failure."""
        keys = [check_key(key) for key in keys]
        wanted = set(keys)
        started = time.perf_counter()
        received, got = 0, {}
        request = messages.FetchRequest(keys=list(dict.fromkeys(keys)), spec_fingerprint=spec.fingerprint,
                                        batch_bytes=BATCH_BYTES)
        call = self._fetch_raw(request, timeout=timeout_s or self.timeout_s)
        try:
            for records in _records_of(call, spec, wanted):
                for key, record in records:
                    got[key] = decode_record(spec, key, bytes(record))
                    received += len(record) - PREFIX_BYTES
        except grpc.RpcError as err:
            self._failed(received, len(got), started)
            raise self._error("fetch", err) from err
        except (TransferError, ValueError) as err:
            call.cancel()
            self._failed(received, len(got), started)
            raise TransferError(f"fetch from {self.address}: {err}") from err
        if len(got) != len(wanted):
            self._failed(received, len(got), started)
            raise TransferError(f"fetch from {self.address}: peer sent {len(got)} of {len(wanted)} blocks")
        self._meter.add(transfers=1, blocks_received=len(got), bytes_received=received,
                        busy_s=time.perf_counter() - started)
        return [got[key] for key in keys]

    def push(self, keys: Iterable[BlockKey], *, timeout_s: float | None = None) -> TransferResult:
        """Copy the blocks of ``keys`` that the peer lacks from this pool to it.

        Raises BlocksNotFoundError (nothing sent) if this pool lacks any, TransferError on any other failure.
        The records go as stored, checked end to end by the peer (hashed as they land there) instead of here too:
        one the peer refuses is named back (``CORRUPT_KEYS_METADATA``) and checked here then; damaged here, it is
        dropped from this pool (as any read that fails its checksum drops it) and reported as
        BlocksNotFoundError naming it, as a block found damaged before it was sent always was; sound here, it was
        damaged on the way (TransferError, DATA_LOSS). Either way ``stored`` lists the blocks before it.
        """
        keys = _unique(keys)
        absent = [key for key in keys if key not in self.pool]
        if absent:
            raise BlocksNotFoundError(f"push to {self.address}: this pool lacks {describe_keys(absent)}", absent)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        reply = self._has(keys, timeout_s)
        present = list(reply.present)
        batch_bytes = min(reply.batch_bytes, BATCH_BYTES)  # 0 from an older build: one piece per message
        to_send = [key for key, held in zip(keys, present) if not held]
        skipped = [key for key, held in zip(keys, present) if held]
        started = time.perf_counter()
        sent: list[BlockKey] = []
        lost: list[BlockKey] = []

        def outgoing_messages(rest: list[BlockKey]) -> Iterator[bytes]:
            with Outgoing(self.pool, rest, batch_bytes, verify=False) as outgoing:
                for message, keys_sent in outgoing:
                    yield message
                    sent.extend(keys_sent)
                if outgoing.lost is not None:  # failed its checksum here: the stream ends cleanly, reported after
                    lost.append(outgoing.lost)

        plane = self.plane(pushing=True, deadline=deadline) if to_send else self.data_plane
        with self.pool.pin(to_send):
            plane, rest = self._socket_first(plane, to_send, sent,
                                             lambda: lost.extend(self._push_socket(to_send, started, deadline, sent)))
            if rest and plane == "jax":
                lost.extend(self._push_offered(rest, started, deadline, sent))
            elif rest:
                order = [*sent, *rest]
                try:
                    self._push_raw(outgoing_messages(rest), timeout=max(deadline - time.monotonic(), 0.001))
                except grpc.RpcError as err:
                    raise self._push_error(err, order, sent, started, stored=False) from err
        sent_bytes = len(sent) * self.pool.frame_bytes
        seconds = time.perf_counter() - started
        self._meter.add(
            transfers=1, blocks_sent=len(sent), bytes_sent=sent_bytes, blocks_skipped=len(skipped), busy_s=seconds
        )
        if lost:
            message = f"push to {self.address}: block {lost[0]:#018x} failed its checksum here"
            raise BlocksNotFoundError(message, lost, stored=sent)
        return TransferResult(sent, skipped, sent_bytes, seconds)

    def _socket_first(self, plane: str, keys: list[BlockKey], moved: list[BlockKey],
                      move: Callable[[], object]) -> tuple[str, list[BlockKey]]:
        """The socket-plane part of a fetch or push, one rule for both: when ``plane`` is "socket", ``move()`` moves
        ``keys`` over it, appending what moved to ``moved``; refused before a group moved (an "auto" client:
        ``_SocketUnusable``), the rest goes over gRPC with this peer from now on. Returns the plane left for the
        rest and the rest of ``keys`` (none after the socket plane: its failures raise)."""
        if keys and plane == "socket":
            try:
                move()
            except _SocketUnusable as err:
                self._socket_refused(str(err))
                plane = "grpc"
            self._meter.add(socket_bytes=len(moved) * self.pool.frame_bytes)
        if keys and plane != "socket" and self.data_plane == "auto":
            self._meter.add(plane_fallbacks=1)
        if plane == "socket":
            return plane, []
        done = set(moved)
        return plane, [key for key in keys if key not in done]

    @contextlib.contextmanager
    def _pulling(self, stored: list[BlockKey], started: float, socket: bool = False) -> Iterator[None]:
        """The errors of a fetch pulled over the device or socket plane, one mapping for both: a failed control call
        is the peer's status (``_error``: BlocksNotFoundError for NOT_FOUND); a corrupt record, a full pool or a
        failed pull is a TransferError; ``stored`` lists the blocks stored before. On the socket plane of an "auto"
        client a control call refused with ``_FALLBACK_CODES`` or a pull that could not connect moved nothing of
        its group: ``_SocketUnusable`` (the caller moves the rest over gRPC)."""
        auto = socket and self.data_plane == "auto"
        try:
            yield
        except grpc.RpcError as err:
            if auto and err.code() in _FALLBACK_CODES:
                raise _SocketUnusable(f"{err.code().name}: {err.details()}") from err
            self._failed(len(stored) * self.pool.frame_bytes, len(stored), started)
            raise self._error("fetch", err, stored) from err
        except PullError as err:
            if auto and not err.connected:
                raise _SocketUnusable(str(err)) from err
            self._failed(len(stored) * self.pool.frame_bytes, len(stored), started)
            raise TransferError(f"fetch from {self.address}: {err}", stored=stored) from err
        except TransferError:
            raise
        except (ValueError, PoolFullError, RuntimeError) as err:  # a corrupt record, a full pool, a failed pull
            self._failed(len(stored) * self.pool.frame_bytes, len(stored), started)
            raise TransferError(f"fetch from {self.address}: {err}", stored=stored) from err

    def _push_error(self, err: grpc.RpcError, order: list[BlockKey], sent: list[BlockKey], started: float,
                    stored: bool = True) -> Exception:
        """The error for a push whose call ``err`` ended, one mapping for every plane: a record the peer refused is
        checked here (``_refused``), else the peer's status (``_error``). ``order``: the blocks in the order they
        were sent; ``stored``: whether ``sent`` are known stored there (a pull's groups are; a stream's messages
        are only sent)."""
        self._failed(len(sent) * self.pool.frame_bytes, 0, started, sending=True)
        return self._refused(err, order) or self._error("push", err, sent if stored else ())

    def _fetch_socket_checked(self, keys: list[BlockKey], deadline: float, started: float,
                              stored: list[BlockKey]) -> None:
        """A fetch over the socket plane, checked as the gRPC fetch is: the peer offers its records as stored and
        this end checks each as it lands; from one that fails, the rest are offered again, each checked by the peer
        first."""
        if self._fetch_socket(keys, deadline, started, stored, receiver_checks=True):
            self._meter.add(blocks_refused=1)
            arrived = set(stored)
            self._fetch_socket([key for key in keys if key not in arrived], deadline, started, stored,
                               receiver_checks=False)

    def _fetch_socket(self, keys: list[BlockKey], deadline: float, started: float, stored: list[BlockKey],
                      receiver_checks: bool) -> bool:
        """Fetch over the socket plane, per group of blocks: the peer offers their records (``OfferPull``), this
        process pulls them and stores each batch of whole records as it lands, verified (appended to ``stored``).
        With ``receiver_checks`` a record that fails its check here ends it: True. Else such a failure is a
        TransferError, as is any other (``_pulling``)."""
        fingerprint = self.pool.spec.fingerprint
        with self._pulling(stored, started, socket=True):
            for group in groups(keys, self.pool.record_bytes):
                request = messages.FetchRequest(keys=group, spec_fingerprint=fingerprint, data_plane="socket",
                                                receiver_checks=receiver_checks)
                offer = self._stub.OfferPull(request, timeout=max(deadline - time.monotonic(), 0.001))
                if offer.data_plane != "socket":  # an older peer reads the request as one for the device plane
                    raise PullError(f"the peer offered on the {offer.data_plane or 'jax'} plane, not the socket "
                                    f"plane (an older build?): use data_plane=\"grpc\" with it", connected=False)

                def store(first: int, records, group=group) -> None:
                    new: list[bool] = []
                    try:
                        self.pool.put_records(list(zip(group[first:], records)), new)
                    finally:
                        stored.extend(group[first : first + len(new)])

                try:
                    socket_plane().pull(offer.address, offer.pull_token, len(group), self.pool.record_bytes, store,
                                        timeout_s=max(deadline - time.monotonic(), 0.001),
                                        peer_host=host_of(self.address))
                except CorruptBlockError:
                    if receiver_checks:
                        return True
                    raise
        return False

    def _push_socket(self, to_send: list[BlockKey], started: float, deadline: float,
                     sent: list[BlockKey]) -> list[BlockKey]:
        """Push over the socket plane, per group of blocks (pinned by the caller): this process offers their
        records as stored (``BlockPool.record_views``: no copy; the peer checks each as it lands) and the peer
        pulls and stores them (``PullFrom``), each group appended to ``sent`` once stored there. A record the peer
        refuses is checked here (``_refused``), as a gRPC push's is. Returns the lost block (a block this pool can
        no longer serve ends the push), as a list of at most one."""
        fingerprint = self.pool.spec.fingerprint
        plane = socket_plane(self.data_host, self.data_advertise)
        for group in groups(to_send, self.pool.record_bytes):
            records = self.pool.record_views(group)
            if None in records:
                return [group[records.index(None)]]
            remaining = max(deadline - time.monotonic(), 0.001)
            address, token = plane.offer(records, remaining)
            request = messages.PullOffer(address=address, keys=group, spec_fingerprint=fingerprint,
                                         data_plane="socket", pull_token=token)
            try:
                self._stub.PullFrom(request, timeout=remaining)
            except grpc.RpcError as err:
                if self.data_plane == "auto" and err.code() in _FALLBACK_CODES:
                    raise _SocketUnusable(f"{err.code().name}: {err.details()}") from err
                raise self._push_error(err, to_send, sent, started) from err
            finally:
                plane.withdraw(token)
            sent.extend(group)
        return []

    def _fetch_pulled(self, wanted: list[BlockKey], started: float, deadline: float, stored: list[BlockKey]) -> None:
        """Fetch over the device plane: per group of blocks, the peer offers their records, this process pulls
        them and stores each (verified) row (appended to ``stored``)."""
        fingerprint = self.pool.spec.fingerprint
        with self._pulling(stored, started):
            for group in groups(wanted, self.pool.record_bytes):
                remaining = max(deadline - time.monotonic(), 0.001)
                offer = self._stub.OfferPull(messages.FetchRequest(keys=group, spec_fingerprint=fingerprint),
                                             timeout=remaining)
                rows = device_plane().pull(offer.address, offer.pull_id, len(group), self.pool.record_bytes,
                                           timeout_s=max(deadline - time.monotonic(), 0.001))
                for key, row in zip(group, rows):
                    self.pool.put_record(key, memoryview(row))
                    stored.append(key)

    def _push_offered(self, to_send: list[BlockKey], started: float, deadline: float,
                      sent: list[BlockKey]) -> list[BlockKey]:
        """Push over the device plane: per group of blocks, this process offers their records and the peer pulls
        and stores them (appended to ``sent``). Returns the lost block (one that failed its checksum here ends the
        push), as a list of at most one."""
        fingerprint = self.pool.spec.fingerprint
        for group in groups(to_send, self.pool.record_bytes):
            records = []
            for key in group:
                record = self.pool.get_record(key, promote=False)
                if record is None:
                    if records:
                        self._offer(group[: len(records)], records, fingerprint, deadline, started, to_send, sent)
                    return [key]
                records.append(record)
            self._offer(group, records, fingerprint, deadline, started, to_send, sent)
        return []

    def _offer(self, keys: list[BlockKey], records: list[bytes], fingerprint: int, deadline: float, started: float,
               to_send: list[BlockKey], sent: list[BlockKey]) -> None:
        address, pull_id = device_plane().offer(records)
        request = messages.PullOffer(address=address, pull_id=pull_id, keys=keys, spec_fingerprint=fingerprint)
        try:
            self._stub.PullFrom(request, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.RpcError as err:
            raise self._push_error(err, to_send, sent, started) from err
        sent.extend(keys)

    def probe(
        self, total_bytes: int, *, piece_bytes: int = PIECE_BYTES, parse: bool = True, timeout_s: float | None = None
    ) -> float:
        """Bytes per second of a bare stream of ``total_bytes`` from the peer (no pool, no checks).

        ``parse=True`` reads each piece as a protobuf ``BlockPiece`` (what a generic gRPC client does);
        ``parse=False`` counts the raw messages, the way ``fetch`` receives them.
        """
        started = time.perf_counter()
        received = 0
        request = messages.ProbeRequest(total_bytes=total_bytes, piece_bytes=piece_bytes)
        try:
            if parse:
                for piece in self._stub.Probe(request, timeout=timeout_s or self.timeout_s):
                    received += len(piece.data)
            else:
                for raw in self._probe_raw(request, timeout=timeout_s or self.timeout_s):
                    received += len(parse_piece(raw).data)
        except grpc.RpcError as err:
            raise self._error("probe", err) from err
        return received / (time.perf_counter() - started)

    def probe_upload(self, total_bytes: int, *, piece_bytes: int = PIECE_BYTES, parse: bool = False,
                     messages_to_send: Sequence[bytes] | None = None, timeout_s: float | None = None) -> float:
        """Bytes per second of a bare stream of ``total_bytes`` to the peer, in messages of ``piece_bytes`` (one
        prebuilt message sent again and again, or ``messages_to_send``: ``upload_messages``' distinct ones, read
        and dropped there): the same method kind as ``push``, so its fair reference. ``parse=True``: the peer reads
        each message as a protobuf ``BlockPiece`` and its data, as a generic gRPC server would (and
        ``probe(parse=True)``'s client does). TransferError if the peer counted another number of messages."""
        if messages_to_send is None:
            messages_to_send = upload_messages(total_bytes, piece_bytes, distinct=False)
        n_messages = len(messages_to_send)
        upload = self._probe_upload_parsed if parse else self._probe_upload_raw
        started = time.perf_counter()
        try:
            reply = upload(iter(messages_to_send), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as err:
            raise self._error("probe upload to", err) from err
        seconds = time.perf_counter() - started
        if reply.stored != n_messages:
            raise TransferError(f"probe upload to {self.address}: peer counted {reply.stored} of {n_messages} messages")
        return n_messages * piece_bytes / seconds

    def probe_pull(self, records: Sequence[bytes | memoryview], *, timeout_s: float | None = None) -> float:
        """Bytes per second of a bare socket-plane stream of ``records`` (of this pool's record size) to the peer,
        which pulls them into its staging buffer and drops them (no pool, no checks): ``push``'s reference on the
        socket plane. TransferError if the peer counted another number of records."""
        refuse_tls()
        plane = socket_plane(self.data_host, self.data_advertise)
        timeout_s = timeout_s or self.timeout_s
        started = time.perf_counter()
        address, token = plane.offer(records, timeout_s)
        request = messages.PullOffer(address=address, keys=range(len(records)), data_plane="socket",
                                     pull_token=token)
        try:
            reply = self._stub.ProbePull(request, timeout=timeout_s)
        except grpc.RpcError as err:
            raise self._error("probe pull to", err) from err
        finally:
            plane.withdraw(token)
        seconds = time.perf_counter() - started
        if reply.stored != len(records):
            raise TransferError(f"probe pull to {self.address}: peer counted {reply.stored} of {len(records)}")
        return sum(len(record) for record in records) / seconds

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MessengerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _failed(self, n_bytes: int, n_blocks: int, started: float, sending: bool = False) -> None:
        direction = {"bytes_sent": n_bytes} if sending else {"bytes_received": n_bytes, "blocks_received": n_blocks}
        self._meter.add(failures=1, busy_s=time.perf_counter() - started, **direction)

    def _refused(self, err: grpc.RpcError, to_send: list[BlockKey]) -> TransferError | None:
        """The error for a push the peer ended because a record failed its checks there (DATA_LOSS naming it), or
        None for any other failure. The named block is checked here (``get_record`` verifies it, and drops it if
        damaged): the peer stored the blocks before it, in order, and none after."""
        if err.code() != grpc.StatusCode.DATA_LOSS:
            return None
        listed = dict(err.trailing_metadata() or ()).get(CORRUPT_KEYS_METADATA, b"")
        if len(listed) != 8 or struct.unpack("<Q", listed)[0] not in to_send:
            return None
        key = struct.unpack("<Q", listed)[0]
        stored = to_send[: to_send.index(key)]
        if self.pool.get_record(key, promote=False) is None:
            message = f"push to {self.address}: block {key:#018x} failed its checksum here (refused by the peer)"
            return BlocksNotFoundError(message, [key], err.code(), stored)
        message = f"push to {self.address}: block {key:#018x} was damaged on its way (sound here): {err.details()}"
        return TransferError(message, err.code(), stored)

    def _error(self, what: str, err: grpc.RpcError, stored: Sequence[BlockKey] = ()) -> TransferError:
        code, details = err.code(), err.details()
        message = f"{what} {self.address}: {code.name}: {details}"
        if code == grpc.StatusCode.NOT_FOUND:
            listed = dict(err.trailing_metadata() or ()).get(MISSING_KEYS_METADATA, b"")
            keys = list(struct.unpack(f"<{len(listed) // 8}Q", listed))
            return BlocksNotFoundError(message, keys, code, stored)
        return TransferError(message, code, stored)


def upload_messages(total_bytes: int, piece_bytes: int, distinct: bool = True) -> list[bytes]:
    """The messages of ``probe_upload``'s bare stream of ``total_bytes`` in pieces of ``piece_bytes``: one prebuilt
    message repeated (``distinct=False``: the sender reads 2 MiB from cache again and again), or one ``bytes`` of its
    own per piece, all held in memory at once, as a sender's blocks are (what a push reads, it reads from memory)."""
    n_messages = -(-total_bytes // piece_bytes)
    if not distinct:
        return [encode_piece(0, 0, total_bytes, bytes(piece_bytes))] * n_messages
    return [encode_piece(0, i * piece_bytes, total_bytes, bytes(piece_bytes)) for i in range(n_messages)]


def _records_of(call, spec: BlockSpec, asked):
    """The ``(key, record)`` pairs of the whole block records each message of a Fetch stream of ``spec`` blocks
    completes (messages of one piece or several), a list per message; TransferError for a block that was not
    ``asked`` for."""
    assembler = RecordAssembler(spec)
    for raw in call:
        records = assembler.records(raw)
        for key in [key for key, _ in records] + [assembler.pending_key]:
            if key is not None and key not in asked:
                raise TransferError(f"peer sent block {key:#018x}, which was not asked for")
        if records:
            yield records
