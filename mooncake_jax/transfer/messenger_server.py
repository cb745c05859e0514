"""The Messenger's server side: serves one pool's blocks to peers and stores the blocks they push.

Streamed pieces leave as the stored records themselves, as pieces ``pieces.py`` encoded, or several to a message
when the caller takes that (``FetchRequest.batch_bytes``), and pushed messages (of one piece or several, which this
build always takes and says so in ``HasReply.batch_bytes``) arrive as raw bytes that ``pieces.py`` parses (see
there why), so the service is registered with its own handlers
instead of the generated servicer base; the wire format is the .proto's all the same.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Sequence
from concurrent import futures

import grpc

from mooncake_jax.addresses import host_of, join
from mooncake_jax.blocks import BlockKey
from mooncake_jax.proto import GRPC_MAX_MESSAGE_BYTES, server_options
from mooncake_jax.proto.auth import interceptors
from mooncake_jax.proto import tls
from mooncake_jax.proto.tls import add_port
from mooncake_jax.transfer.counters import Meter, TransferCounters
from mooncake_jax.transfer.device_plane import PULL_BYTES, device_plane
from mooncake_jax.transfer.frame import CorruptBlockError
from mooncake_jax.transfer.messenger_wire import (
    CORRUPT_KEYS_METADATA,
    MAX_LISTED_KEYS,
    MISSING_KEYS_METADATA,
    SERVICE,
    describe_keys,
    messages,
)
from mooncake_jax.transfer.outgoing import Outgoing
from mooncake_jax.transfer.pieces import BATCH_BYTES, PIECE_BYTES, RecordAssembler, encode_piece, parse_message
from mooncake_jax.transfer.pool import BlockPool, PoolFullError
from mooncake_jax.transfer.readahead import Ahead
from mooncake_jax.transfer.socket_plane import PullError, socket_plane

_MAX_PROBE_BYTES = 1 << 36


class _Servicer:
    def __init__(self, pool: BlockPool, meter: Meter, data_host: str | None = None, data_advertise: str | None = None,
                 serve_socket: bool = True) -> None:
        self.pool = pool
        self.meter = meter
        self.data_host = data_host  # where this process's socket data plane listens (None: loopback)
        self.data_advertise = data_advertise  # the host its offers name (None: the bound one)
        self.serve_socket = serve_socket  # False: an instance configured data_plane="grpc" (no second listener)

    def _socket_refusal(self, context) -> str | None:
        """Why this server does not serve the socket plane to the caller of ``context``, or None when it does."""
        if not self.serve_socket:
            return "this peer does not serve the socket data plane (it is configured data_plane=\"grpc\")"
        if tls.files() is not None:
            return 'data_plane="socket" does not support TLS (the records would travel in clear text)'
        caller = host_of(context.peer() or "")
        if not socket_plane(self.data_host, self.data_advertise).reachable_from(caller):
            return (f"this peer's socket data plane listens on {self.data_host or '127.0.0.1'}, which the caller at "
                    f"{caller} cannot reach")
        return None

    def _data_planes(self, context) -> list[str]:
        """The planes this server serves to the caller (``HasReply.data_planes``)."""
        return ["grpc", "jax"] + ([] if self._socket_refusal(context) else ["socket"])

    def _check_spec(self, fingerprint: int, context: grpc.ServicerContext) -> None:
        if fingerprint != self.pool.spec.fingerprint:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"block spec mismatch: this pool holds {self.pool.spec.describe()} (fingerprint "
                f"{self.pool.spec.fingerprint:#018x}), the caller's fingerprint is {fingerprint:#018x}",
            )

    def _not_found(self, keys: Sequence[BlockKey], context: grpc.ServicerContext) -> None:
        listed = struct.pack(f"<{min(len(keys), MAX_LISTED_KEYS)}Q", *keys[:MAX_LISTED_KEYS])
        context.set_trailing_metadata(((MISSING_KEYS_METADATA, listed),))
        context.abort(grpc.StatusCode.NOT_FOUND, f"{len(keys)} block(s) not found: {describe_keys(keys)}")

    def Has(self, request, context):
        self._check_spec(request.spec_fingerprint, context)
        return messages.HasReply(present=[key in self.pool for key in request.keys], batch_bytes=BATCH_BYTES,
                                 data_planes=self._data_planes(context))

    def Fetch(self, request, context):
        self._check_spec(request.spec_fingerprint, context)
        keys = list(dict.fromkeys(request.keys))
        started = time.perf_counter()
        with self.pool.pin(keys):  # nothing asked for is evicted while it streams
            missing = [key for key in keys if key not in self.pool]
            if missing:
                self._not_found(missing, context)
            batch_bytes = min(request.batch_bytes, BATCH_BYTES)  # 0 from an older build: one piece per message
            # a caller that checks every record as it lands (and asks again, checked here, for one that fails) is
            # sent the records as stored, their checksums not taken here too (as a push sends them)
            with Outgoing(self.pool, keys, batch_bytes, verify=not request.receiver_checks) as outgoing:
                for message, sent in outgoing:
                    if not context.is_active():
                        return
                    yield message
                    self.meter.add(blocks_sent=len(sent), bytes_sent=len(sent) * self.pool.frame_bytes)
                if outgoing.lost is not None:
                    self._not_found([outgoing.lost], context)
        self.meter.add(transfers=1, busy_s=time.perf_counter() - started)

    def Push(self, request_iterator, context):
        """Store the blocks a peer pushes, the messages taken from gRPC ahead on a thread (block i is stored while
        i+1 arrives)."""
        with Ahead(request_iterator, name="receive-ahead", join=False) as received:
            return self._receive_pushed(received, context)

    def _receive_pushed(self, request_iterator, context):
        assembler = RecordAssembler(self.pool.spec)
        stored = already = 0
        started = time.perf_counter()
        first = True
        for raw in request_iterator:
            try:
                if first and assembler.whole_records(raw) is None:  # whole records of this spec pass the check
                    self._check_spec(parse_message(raw)[0][0].spec_fingerprint, context)
                first = False
                records = assembler.records(raw)
            except ValueError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err}; {stored} earlier block(s) were stored")
            if records:
                new, old = self._store(records, stored, context)
                stored, already = stored + new, already + old
                self.meter.add(blocks_received=len(records), bytes_received=len(records) * self.pool.frame_bytes)
        if assembler.pending_key is not None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stream ended inside block {assembler.pending_key:#018x}, which was dropped; "
                f"{stored} earlier block(s) were stored",
            )
        self.meter.add(transfers=1, blocks_skipped=already, busy_s=time.perf_counter() - started)
        return messages.PushReply(stored=stored, already_present=already)

    def _store(self, records, stored: int, context) -> tuple[int, int]:
        """Put received ``(key, record)`` pairs into the pool in one call; how many were new and how many already
        there. A record that fails its checks or a full pool ends the call with DATA_LOSS / INVALID_ARGUMENT /
        RESOURCE_EXHAUSTED (``stored`` earlier ones and those of ``records`` before it kept)."""
        new: list[bool] = []
        try:
            self.pool.put_records(records, new)
        except CorruptBlockError as err:  # refused, counted, and named to the sender, which checks its own copy
            self.meter.add(blocks_refused=1)
            context.set_trailing_metadata(((CORRUPT_KEYS_METADATA, struct.pack("<Q", records[len(new)][0])),))
            context.abort(grpc.StatusCode.DATA_LOSS, f"{err}; {stored + sum(new)} earlier block(s) were stored")
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err}; {stored + sum(new)} earlier block(s) were stored")
        except PoolFullError as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        return sum(new), len(new) - sum(new)

    def _socket_plane(self, context):
        """This process's socket data plane, or FAILED_PRECONDITION where it is refused (TLS, not served, not
        reachable from the caller): nothing has moved then, so a client of data_plane="auto" moves the blocks over
        gRPC instead."""
        why = self._socket_refusal(context)
        if why is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return socket_plane(self.data_host, self.data_advertise)

    def OfferPull(self, request, context):
        """Offer the records of the keys on the device plane or the socket plane (at most ``PULL_BYTES``)."""
        self._check_spec(request.spec_fingerprint, context)
        keys = list(dict.fromkeys(request.keys))
        if not keys or len(keys) * self.pool.record_bytes > max(PULL_BYTES, self.pool.record_bytes):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"offer {len(keys)} blocks: between 1 and {max(1, PULL_BYTES // self.pool.record_bytes)}")
        if request.data_plane == "socket":
            return self._offer_on_socket(keys, request.receiver_checks, context)
        if request.data_plane not in ("", "jax"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"data_plane must be one of jax, socket, got {request.data_plane!r}")
        started = time.perf_counter()
        with self.pool.pin(keys):
            missing = [key for key in keys if key not in self.pool]
            if missing:
                self._not_found(missing, context)
            records = []
            for key in keys:
                record = self.pool.get_record(key, promote=False)
                if record is None:
                    self._not_found([key], context)
                records.append(record)
        address, pull_id = device_plane().offer(records)
        self.meter.add(transfers=1, blocks_sent=len(keys), bytes_sent=len(keys) * self.pool.frame_bytes,
                       busy_s=time.perf_counter() - started)
        return messages.PullOffer(address=address, pull_id=pull_id, keys=keys,
                                  spec_fingerprint=self.pool.spec.fingerprint)

    def _offer_on_socket(self, keys: list[BlockKey], receiver_checks: bool, context):
        """Offer the records of ``keys`` on the socket plane, pinned until pulled or expired: as stored, not copied
        (``BlockPool.record_views``) for a caller that checks each as it lands, else each read and verified here
        (one that fails is dropped here and named NOT_FOUND, as a Fetch does)."""
        plane = self._socket_plane(context)
        remaining = context.time_remaining()
        started = time.perf_counter()
        pins = contextlib.ExitStack()
        pins.enter_context(self.pool.pin(keys))
        try:
            missing = [key for key in keys if key not in self.pool]
            if missing:
                self._not_found(missing, context)
            if receiver_checks:
                records = self.pool.record_views(keys)
            else:
                records = [self.pool.get_record(key, promote=False) for key in keys]
            lost = [key for key, record in zip(keys, records) if record is None]
            if lost:
                self._not_found(lost[:1], context)
            address, token = plane.offer(records, remaining if remaining is not None else 60.0, release=pins.close)
        except BaseException:
            pins.close()
            raise
        self.meter.add(transfers=1, blocks_sent=len(keys), bytes_sent=len(keys) * self.pool.frame_bytes,
                       socket_bytes=len(keys) * self.pool.frame_bytes, busy_s=time.perf_counter() - started)
        return messages.PullOffer(address=address, keys=keys, spec_fingerprint=self.pool.spec.fingerprint,
                                  data_plane="socket", pull_token=token)

    def PullFrom(self, request, context):
        """Pull the records the caller offers on the device plane or the socket plane and store them."""
        self._check_spec(request.spec_fingerprint, context)
        keys = list(request.keys)
        if not keys or len(set(keys)) != len(keys) or len(keys) * self.pool.record_bytes > max(
                PULL_BYTES, self.pool.record_bytes):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pull of {len(keys)} blocks: need 1 to "
                          f"{max(1, PULL_BYTES // self.pool.record_bytes)} distinct keys")
        if request.data_plane == "socket":
            return self._pull_from_socket(request, keys, context)
        if request.data_plane not in ("", "jax"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"data_plane must be one of jax, socket, got {request.data_plane!r}")
        started = time.perf_counter()
        remaining = context.time_remaining()
        try:
            rows = device_plane().pull(request.address, request.pull_id, len(keys), self.pool.record_bytes,
                                       timeout_s=remaining if remaining is not None else 60.0)
        except Exception as err:  # the peer's offer is gone, or the link failed
            context.abort(grpc.StatusCode.UNAVAILABLE, f"pull {request.pull_id} from {request.address}: {err}")
        stored, already = self._store([(key, memoryview(row)) for key, row in zip(keys, rows)], 0, context)
        self.meter.add(transfers=1, blocks_received=stored, blocks_skipped=already,
                       bytes_received=stored * self.pool.frame_bytes, busy_s=time.perf_counter() - started)
        return messages.PushReply(stored=stored, already_present=already)

    def _pull_from_socket(self, request, keys: list[BlockKey], context):
        """Pull the caller's socket offer, storing each batch of whole records as it lands (``_store``: a record
        that fails its check ends the call with DATA_LOSS naming it, a full pool with RESOURCE_EXHAUSTED); a link
        failure is UNAVAILABLE with the blocks stored so far."""
        plane = self._socket_plane(context)
        started = time.perf_counter()
        remaining = context.time_remaining()
        counts = [0, 0]  # new, already held

        def store(first: int, records) -> None:
            new, old = self._store(list(zip(keys[first:], records)), counts[0], context)
            counts[0] += new
            counts[1] += old

        try:
            plane.pull(request.address, request.pull_token, len(keys), self.pool.record_bytes, store,
                       timeout_s=remaining if remaining is not None else 60.0, peer_host=host_of(context.peer()))
        except PullError as err:  # not connected: nothing moved (FAILED_PRECONDITION, as a plane not served)
            context.abort(grpc.StatusCode.UNAVAILABLE if err.connected else grpc.StatusCode.FAILED_PRECONDITION,
                          f"{err}; {counts[0]} earlier block(s) were stored")
        stored, already = counts
        self.meter.add(transfers=1, blocks_received=stored, blocks_skipped=already,
                       bytes_received=stored * self.pool.frame_bytes, socket_bytes=stored * self.pool.frame_bytes,
                       busy_s=time.perf_counter() - started)
        return messages.PushReply(stored=stored, already_present=already)

    def ProbePull(self, request, context):
        """The socket plane's bare stream: pull the caller's offer into the staging buffer and drop it (no pool)."""
        plane = self._socket_plane(context)
        remaining = context.time_remaining()
        counted = [0]

        def drop(first: int, records) -> None:
            counted[0] += len(records)

        try:
            plane.pull(request.address, request.pull_token, len(request.keys), self.pool.record_bytes, drop,
                       timeout_s=remaining if remaining is not None else 60.0, peer_host=host_of(context.peer()))
        except PullError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return messages.PushReply(stored=counted[0])

    def Probe(self, request, context):
        piece_bytes = request.piece_bytes or PIECE_BYTES
        if request.total_bytes > _MAX_PROBE_BYTES or piece_bytes > GRPC_MAX_MESSAGE_BYTES // 2:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"probe of {request.total_bytes} bytes in pieces of {piece_bytes}: limits are {_MAX_PROBE_BYTES} "
                f"and {GRPC_MAX_MESSAGE_BYTES // 2}",
            )
        total = request.total_bytes
        whole = encode_piece(0, 0, total, bytes(piece_bytes))  # one message object sent again and again
        for offset in range(0, total, piece_bytes):
            if not context.is_active():
                return
            yield whole if total - offset >= piece_bytes else encode_piece(0, offset, total, bytes(total - offset))

    def ProbeUpload(self, request_iterator, context):
        """The push direction's bare stream: raw messages read and dropped; replies how many arrived (``stored``)."""
        received = 0
        for _ in request_iterator:
            received += 1
        return messages.PushReply(stored=received)

    def ProbeUploadParsed(self, request_iterator, context):
        """``ProbeUpload`` with each message parsed as a ``BlockPiece`` and its data read, as a generic server would
        (``Probe``'s parsing client, the other way)."""
        received = 0
        for piece in request_iterator:
            received += bool(piece.data)
        return messages.PushReply(stored=received)


def _handlers(servicer: _Servicer) -> grpc.GenericRpcHandler:
    """The service's handlers; streamed BlockPieces travel as raw bytes, encoded and parsed by ``pieces.py``."""

    def as_is(data: bytes) -> bytes:
        return data

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Has": grpc.unary_unary_rpc_method_handler(
                servicer.Has, messages.HasRequest.FromString, messages.HasReply.SerializeToString
            ),
            "Fetch": grpc.unary_stream_rpc_method_handler(servicer.Fetch, messages.FetchRequest.FromString, as_is),
            "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, as_is, messages.PushReply.SerializeToString),
            "Probe": grpc.unary_stream_rpc_method_handler(servicer.Probe, messages.ProbeRequest.FromString, as_is),
            "ProbeUpload": grpc.stream_unary_rpc_method_handler(
                servicer.ProbeUpload, as_is, messages.PushReply.SerializeToString
            ),
            "ProbeUploadParsed": grpc.stream_unary_rpc_method_handler(
                servicer.ProbeUploadParsed, messages.BlockPiece.FromString, messages.PushReply.SerializeToString
            ),
            "OfferPull": grpc.unary_unary_rpc_method_handler(
                servicer.OfferPull, messages.FetchRequest.FromString, messages.PullOffer.SerializeToString
            ),
            "PullFrom": grpc.unary_unary_rpc_method_handler(
                servicer.PullFrom, messages.PullOffer.FromString, messages.PushReply.SerializeToString
            ),
            "ProbePull": grpc.unary_unary_rpc_method_handler(
                servicer.ProbePull, messages.PullOffer.FromString, messages.PushReply.SerializeToString
            ),
        },
    )


def add_messenger(server: grpc.Server, pool: BlockPool, data_host: str | None = None, data_advertise: str | None = None,
                  serve_socket: bool = True) -> Meter:
    """Serve ``pool`` through the Messenger service on an existing gRPC server (an instance serves its own RPCs and
    its Messenger on one port); returns the meter counting what moves. The server must have the raised message
    limits of ``channel_options()``. ``data_host``: where the socket data plane listens (the server's host; None:
    loopback); ``data_advertise``: the host its offers name (None: ``data_host``; a wildcard ``data_host`` with
    nothing advertised lets each puller use the host it reaches this server at); ``serve_socket=False``: no socket
    plane (the peers' clients of data_plane="auto" then keep gRPC, told so in ``HasReply.data_planes``)."""
    meter = Meter()
    server.add_generic_rpc_handlers((_handlers(_Servicer(pool, meter, data_host, data_advertise, serve_socket)),))
    return meter


class MessengerServer:
    """Serves ``pool`` to peers on ``host:port`` (port 0: a free one, read back from ``.port``); its socket data
    plane listens on ``host`` too (``serve_socket=False``: none; ``data_advertise``: the host its offers name)."""

    def __init__(self, pool: BlockPool, *, host: str = "127.0.0.1", port: int = 0, max_workers: int = 8,
                 auth_token: str | None = None, serve_socket: bool = True, data_advertise: str | None = None) -> None:
        self.pool = pool
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers), options=server_options(),
                                   interceptors=interceptors(auth_token))
        self._meter = add_messenger(self._server, pool, data_host=host, data_advertise=data_advertise,
                                    serve_socket=serve_socket)
        try:
            self.port = add_port(self._server, join(host, port))
        except RuntimeError as err:
            raise ValueError(f"cannot listen on {join(host, port)}: {err}") from err
        if not self.port:
            raise ValueError(f"cannot listen on {join(host, port)}")
        self.address = join(host, self.port)

    @property
    def counters(self) -> TransferCounters:
        return self._meter.snapshot()

    def start(self) -> MessengerServer:
        self._server.start()
        return self

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._server.stop(grace_s).wait()

    def __enter__(self) -> MessengerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
