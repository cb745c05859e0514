"""Messenger: the per-instance gRPC service and client that move KVCache blocks between pools.

The paper moves blocks with GPUDirect RDMA; gRPC streaming is the portable data plane here, behind an interface
(fetch by keys, push by keys) that a device-native path could implement too. Both directions skip the blocks
the receiver already holds (a fetch asks only for what its pool lacks, a push first asks the peer), frames travel
in pieces (``pieces.py``) and are verified before they are stored, so a transfer that dies midway leaves only
whole, checked blocks behind, each announced by the pool's STORED event. Every call has a deadline.

Server side, ``MessengerServer(pool).start()``; client side, ``MessengerClient(address, pool)``:
``fetch(keys)`` for on-demand loads, ``push(keys)`` for transfers the Conductor schedules.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent import futures

import grpc

from mooncake_jax.blocks import BlockKey
from mooncake_jax.proto import CHUNK_BYTES, GRPC_MAX_MESSAGE_BYTES, channel_options, load
from mooncake_jax.transfer.counters import TransferCounters
from mooncake_jax.transfer.frame import CorruptBlockError, check_key
from mooncake_jax.transfer.pieces import FrameAssembler, split
from mooncake_jax.transfer.pool import BlockPool, PoolFullError

messages, services = load("messenger")

MISSING_KEYS_METADATA = "mooncake-missing-keys-bin"
"""Trailing metadata of a NOT_FOUND: the missing keys as packed little-endian uint64 (at most MAX_LISTED_KEYS)."""
MAX_LISTED_KEYS = 512
_NAMED_IN_MESSAGE = 16
_MAX_PROBE_BYTES = 1 << 36


def describe_keys(keys: Sequence[BlockKey]) -> str:
    """Keys in hex for a message, the first few of a long list and a count of the rest."""
    named = ", ".join(f"{key:#018x}" for key in keys[:_NAMED_IN_MESSAGE])
    more = len(keys) - _NAMED_IN_MESSAGE
    return named + (f" and {more} more" if more > 0 else "")


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


class _Meter:
    """Thread-safe TransferCounters (a server runs several calls at once)."""

    def __init__(self) -> None:
        self.counters = TransferCounters()
        self._lock = threading.Lock()

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)

    def snapshot(self) -> TransferCounters:
        with self._lock:
            return dataclasses.replace(self.counters)


def _unique(keys: Iterable[BlockKey]) -> list[BlockKey]:
    return list(dict.fromkeys(check_key(key) for key in keys))


class _Servicer(services.MessengerServicer):
    def __init__(self, pool: BlockPool, meter: _Meter) -> None:
        self.pool = pool
        self.meter = meter

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
        return messages.HasReply(present=[key in self.pool for key in request.keys])

    def Fetch(self, request, context):
        self._check_spec(request.spec_fingerprint, context)
        keys = list(dict.fromkeys(request.keys))
        started = time.perf_counter()
        with self.pool.pin(keys):  # nothing asked for is evicted while it streams
            missing = [key for key in keys if key not in self.pool]
            if missing:
                self._not_found(missing, context)
            for key in keys:
                frame = self.pool.get_frame(key, promote=False)
                if frame is None:  # failed its checksum just now: gone from the pool
                    self._not_found([key], context)
                for offset, data in split(frame):
                    if not context.is_active():
                        return
                    yield messages.BlockPiece(key=key, offset=offset, frame_bytes=len(frame), data=data)
                self.meter.add(blocks_sent=1, bytes_sent=len(frame))
        self.meter.add(transfers=1, busy_s=time.perf_counter() - started)

    def Push(self, request_iterator, context):
        assembler = FrameAssembler(self.pool.frame_bytes)
        stored = already = 0
        started = time.perf_counter()
        first = True
        for piece in request_iterator:
            if first:
                self._check_spec(piece.spec_fingerprint, context)
                first = False
            try:
                frame = assembler.add(piece.key, piece.offset, piece.frame_bytes, piece.data)
                if frame is None:
                    continue
                if self.pool.put_frame(piece.key, frame):
                    stored += 1
                else:
                    already += 1
            except CorruptBlockError as err:
                context.abort(grpc.StatusCode.DATA_LOSS, f"{err}; {stored} earlier block(s) were stored")
            except ValueError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err}; {stored} earlier block(s) were stored")
            except PoolFullError as err:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            self.meter.add(blocks_received=1, bytes_received=len(frame))
        if assembler.pending_key is not None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stream ended inside block {assembler.pending_key:#018x}, which was dropped; "
                f"{stored} earlier block(s) were stored",
            )
        self.meter.add(transfers=1, blocks_skipped=already, busy_s=time.perf_counter() - started)
        return messages.PushReply(stored=stored, already_present=already)

    def Probe(self, request, context):
        piece_bytes = request.piece_bytes or CHUNK_BYTES
        if request.total_bytes > _MAX_PROBE_BYTES or piece_bytes > GRPC_MAX_MESSAGE_BYTES // 2:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"probe of {request.total_bytes} bytes in pieces of {piece_bytes}: limits are {_MAX_PROBE_BYTES} "
                f"and {GRPC_MAX_MESSAGE_BYTES // 2}",
            )
        filler = bytes(piece_bytes)
        for offset in range(0, request.total_bytes, piece_bytes):
            if not context.is_active():
                return
            data = filler if request.total_bytes - offset >= piece_bytes else filler[: request.total_bytes - offset]
            yield messages.BlockPiece(offset=offset, frame_bytes=request.total_bytes, data=data)


class MessengerServer:
    """Serves ``pool`` to peers on ``host:port`` (port 0: a free one, read back from ``.port``)."""

    def __init__(self, pool: BlockPool, *, host: str = "127.0.0.1", port: int = 0, max_workers: int = 8) -> None:
        self.pool = pool
        self._meter = _Meter()
        # no SO_REUSEPORT: a second server on a taken port must fail, not silently share its calls
        options = [*channel_options(), ("grpc.so_reuseport", 0)]
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers), options=options)
        services.add_MessengerServicer_to_server(_Servicer(pool, self._meter), self._server)
        try:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as err:
            raise ValueError(f"cannot listen on {host}:{port}: {err}") from err
        if not self.port:
            raise ValueError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"

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


class MessengerClient:
    """Moves blocks between ``pool`` and the Messenger at ``address``; every call has a deadline."""

    def __init__(self, address: str, pool: BlockPool, *, timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.pool = pool
        self.timeout_s = timeout_s
        self._meter = _Meter()
        self._channel = grpc.insecure_channel(address, options=channel_options())
        self._stub = services.MessengerStub(self._channel)

    @property
    def counters(self) -> TransferCounters:
        return self._meter.snapshot()

    def has(self, keys: Iterable[BlockKey], *, timeout_s: float | None = None) -> list[bool]:
        """Which of ``keys`` the peer holds."""
        keys = [check_key(key) for key in keys]
        request = messages.HasRequest(keys=keys, spec_fingerprint=self.pool.spec.fingerprint)
        try:
            return list(self._stub.Has(request, timeout=timeout_s or self.timeout_s).present)
        except grpc.RpcError as err:
            raise self._error("has", err) from err

    def fetch(self, keys: Iterable[BlockKey], *, timeout_s: float | None = None) -> TransferResult:
        """Copy the blocks of ``keys`` that this pool lacks from the peer into it.

        Raises BlocksNotFoundError (nothing sent) if the peer lacks any, TransferError on any other failure.
        """
        keys = _unique(keys)
        wanted = [key for key in keys if key not in self.pool]
        skipped = sorted(set(keys) - set(wanted), key=keys.index)
        started = time.perf_counter()
        stored: list[BlockKey] = []
        received = 0
        if wanted:
            request = messages.FetchRequest(keys=wanted, spec_fingerprint=self.pool.spec.fingerprint)
            call = self._stub.Fetch(request, timeout=timeout_s or self.timeout_s)
            assembler = FrameAssembler(self.pool.frame_bytes)
            expected = set(wanted)
            try:
                for piece in call:
                    if piece.key not in expected:
                        raise TransferError(f"peer sent block {piece.key:#018x}, which was not asked for")
                    frame = assembler.add(piece.key, piece.offset, piece.frame_bytes, piece.data)
                    if frame is not None:
                        self.pool.put_frame(piece.key, frame)
                        stored.append(piece.key)
                        received += len(frame)
            except grpc.RpcError as err:
                self._failed(received, len(stored), started)
                raise self._error("fetch", err, stored) from err
            except (TransferError, ValueError, PoolFullError) as err:
                call.cancel()
                self._failed(received, len(stored), started)
                raise TransferError(f"fetch from {self.address}: {err}", stored=stored) from err
            if len(stored) != len(wanted):
                self._failed(received, len(stored), started)
                raise TransferError(f"fetch from {self.address}: peer sent {len(stored)} of {len(wanted)} blocks", stored=stored)
        seconds = time.perf_counter() - started
        self._meter.add(transfers=1, blocks_received=len(stored), bytes_received=received, blocks_skipped=len(skipped), busy_s=seconds)
        return TransferResult(stored, skipped, received, seconds)

    def push(self, keys: Iterable[BlockKey], *, timeout_s: float | None = None) -> TransferResult:
        """Copy the blocks of ``keys`` that the peer lacks from this pool to it.

        Raises BlocksNotFoundError (nothing sent) if this pool lacks any, TransferError on any other failure.
        """
        keys = _unique(keys)
        absent = [key for key in keys if key not in self.pool]
        if absent:
            raise BlocksNotFoundError(f"push to {self.address}: this pool lacks {describe_keys(absent)}", absent)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        present = self.has(keys, timeout_s=timeout_s)
        to_send = [key for key, held in zip(keys, present) if not held]
        skipped = [key for key, held in zip(keys, present) if held]
        started = time.perf_counter()
        sent: list[BlockKey] = []
        lost: list[BlockKey] = []
        sent_bytes = 0

        def pieces() -> Iterator:
            nonlocal sent_bytes
            fingerprint = self.pool.spec.fingerprint
            for key in to_send:
                frame = self.pool.get_frame(key, promote=False)
                if frame is None:  # failed its checksum here: end the stream cleanly, report after
                    lost.append(key)
                    return
                for offset, data in split(frame):
                    yield messages.BlockPiece(
                        key=key, offset=offset, frame_bytes=len(frame), data=data, spec_fingerprint=fingerprint
                    )
                    fingerprint = 0
                sent.append(key)
                sent_bytes += len(frame)

        if to_send:
            with self.pool.pin(to_send):
                try:
                    self._stub.Push(pieces(), timeout=max(deadline - time.monotonic(), 0.001))
                except grpc.RpcError as err:
                    self._failed(sent_bytes, 0, started, sending=True)
                    raise self._error("push", err) from err
        seconds = time.perf_counter() - started
        self._meter.add(transfers=1, blocks_sent=len(sent), bytes_sent=sent_bytes, blocks_skipped=len(skipped), busy_s=seconds)
        if lost:
            raise BlocksNotFoundError(f"push to {self.address}: block {lost[0]:#018x} failed its checksum here", lost, stored=sent)
        return TransferResult(sent, skipped, sent_bytes, seconds)

    def probe(self, total_bytes: int, *, piece_bytes: int = CHUNK_BYTES, timeout_s: float | None = None) -> float:
        """Bytes per second of a bare stream of ``total_bytes`` from the peer (no pool, no checks)."""
        started = time.perf_counter()
        received = 0
        try:
            for piece in self._stub.Probe(
                messages.ProbeRequest(total_bytes=total_bytes, piece_bytes=piece_bytes), timeout=timeout_s or self.timeout_s
            ):
                received += len(piece.data)
        except grpc.RpcError as err:
            raise self._error("probe", err) from err
        return received / (time.perf_counter() - started)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MessengerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _failed(self, n_bytes: int, n_blocks: int, started: float, sending: bool = False) -> None:
        direction = {"bytes_sent": n_bytes} if sending else {"bytes_received": n_bytes, "blocks_received": n_blocks}
        self._meter.add(failures=1, busy_s=time.perf_counter() - started, **direction)

    def _error(self, what: str, err: grpc.RpcError, stored: Sequence[BlockKey] = ()) -> TransferError:
        code, details = err.code(), err.details()
        message = f"{what} {self.address}: {code.name}: {details}"
        if code == grpc.StatusCode.NOT_FOUND:
            listed = dict(err.trailing_metadata() or ()).get(MISSING_KEYS_METADATA, b"")
            keys = list(struct.unpack(f"<{len(listed) // 8}Q", listed))
            return BlocksNotFoundError(message, keys, code, stored)
        return TransferError(message, code, stored)
