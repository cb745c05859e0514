"""Records on the wire: sent whole when they fit one message, else cut into pieces; read back without protobuf.

gRPC caps a message (4 MiB by default, and a 70B model's block is 160 MiB), so a frame travels as ``BlockPiece``
messages of at most ``PIECE_BYTES`` of data. A record whose frame fits one piece is already that piece's wire
bytes (``frame.py``), so it is sent as the bytes a tier read returned and stored as the bytes gRPC delivered:
no copy on either side beyond the transport's own. Larger frames are cut here, each piece encoded by hand
(joining a short header to a slice of the frame runs at memory speed; building a protobuf object per piece
runs slower than the link), and reassembled into a record by the receiver.

Received pieces are parsed here too, by hand, giving the data as a view into the received bytes: protobuf's
parser would copy the data once into its arena and again into a ``bytes`` when read. A message of whole records, as
this build sends them, is not parsed field by field at all: each record's 64-byte prefix is compared with the one
its key gives (``RecordAssembler.whole_records``), and its records are stored in one pool call (``put_records``).

Small blocks travel several to a message (``batched``; the budget ``BATCH_BYTES``): the first record as it is, the
others behind it as ``BlockPiece.next`` fields, so a message of one record is still the record itself. gRPC's
synchronous Python API costs a thread hand-off or two and a ``bytes`` per message at each end, and the Messenger's
own reading, parsing and storing per message more: at 384 KiB that per-message cost, not the bytes, bounded a
transfer. A message of several costs one copy (the join); a peer of an older build never receives one (it does not
say it takes them, ``FetchRequest.batch_bytes`` / ``HasReply.batch_bytes``), and a message of one piece is read by
either build.

The assembler accepts pieces only in order and of the one frame size the pool's spec allows, so a confused or
hostile peer cannot make it buffer more than one frame, and a block whose pieces stop coming is never handed on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.frame import frame_bytes as frame_size
from mooncake_jax.transfer.frame import (
    PREFIX_BYTES,
    TAG_DATA,
    TAG_FRAME_BYTES,
    TAG_KEY,
    TAG_OFFSET,
    TAG_NEXT,
    TAG_SPEC,
    record_prefix,
    varint,
)
from mooncake_jax.transfer.spec import BlockSpec

PIECE_BYTES = 4 * 1024 * 1024 - 4096
"""Most data bytes in one piece: with its few header bytes a piece stays under gRPC's default 4 MiB message cap
(foreign peers keep that default), and the blocks of common models (a few MiB) travel as one message each."""


BATCH_BYTES = 2 * 1024 * 1024
"""Most bytes of one message carrying several pieces: five 16-token blocks of the ``small`` preset (384 KiB each),
while a 3 MiB block still travels alone, as the record itself (no join). A bare gRPC stream on loopback here moves
1-2 MiB messages at least as fast as 384 KiB or 4 MiB ones (1.5-1.6 / 1.9-2.1 GB/s down / up, 1.3-1.4 / 1.6-1.8 at
4 MiB, load 3.2)."""
_NEXT_FIELD_BYTES = 11  # a ``next`` field's tag and length at most: counted against the budget
_NEXT_TAG = bytes((TAG_NEXT,))


def encode_piece(
    key: BlockKey, offset: int, frame_bytes: int, data: bytes | memoryview, spec_fingerprint: int = 0
) -> bytes:
    """Wire bytes of ``BlockPiece{key, offset, frame_bytes, data, spec_fingerprint}`` (proto3: zeros omitted)."""
    fields = [b"\x08", varint(key)] if key else []
    if offset:
        fields += [b"\x10", varint(offset)]
    if frame_bytes:
        fields += [b"\x18", varint(frame_bytes)]
    if len(data):
        fields += [b"\x22", varint(len(data)), data]
    if spec_fingerprint:
        fields += [b"\x28", varint(spec_fingerprint)]
    return b"".join(fields)


def piece_bytes_for(frame_bytes: int, limit: int = PIECE_BYTES) -> int:
    """Data bytes per piece of a frame: as few pieces as ``limit`` allows, of near-equal size."""
    n_pieces = max(1, -(-frame_bytes // limit))
    return -(-frame_bytes // n_pieces)


def record_pieces(
    key: BlockKey, record: bytes, spec_fingerprint: int, limit: int = PIECE_BYTES
) -> Iterator[bytes]:
    """The wire messages of ``key``'s record: the record itself if its frame fits one piece, else pieces of it
    (the first carrying ``spec_fingerprint``, as the record does)."""
    n_frame = len(record) - PREFIX_BYTES
    if n_frame <= limit:
        yield record
        return
    size = piece_bytes_for(n_frame, limit)
    frame = memoryview(record)[PREFIX_BYTES:]
    for offset in range(0, n_frame, size):
        yield encode_piece(key, offset, n_frame, frame[offset : offset + size], 0 if offset else spec_fingerprint)


def records_per_message(frame_bytes: int, budget: int = BATCH_BYTES) -> int:
    """How many whole records of frames of ``frame_bytes`` one message carries under ``budget`` (at least one)."""
    if frame_bytes > PIECE_BYTES:
        return 1
    return max(1, (budget + _NEXT_FIELD_BYTES) // (PREFIX_BYTES + frame_bytes + _NEXT_FIELD_BYTES))


def next_separator(record_bytes: int) -> bytes:
    """What goes before each record after the first in a message of several: the tag and length of ``next``."""
    return _NEXT_TAG + varint(record_bytes)


def message_bytes(frame_bytes: int, budget: int = BATCH_BYTES) -> int:
    """Bytes of a full streamed message of frames of ``frame_bytes`` (several records joined up to ``budget``, one
    record, or a piece of a larger frame): the message size a bare stream must use to be a fair reference."""
    record = PREFIX_BYTES + frame_bytes
    if frame_bytes > PIECE_BYTES:
        return piece_bytes_for(frame_bytes)
    per_message = records_per_message(frame_bytes, budget)
    return per_message * record + (per_message - 1) * len(next_separator(record))


def batched(records: Iterable[tuple[BlockKey, bytes]], spec_fingerprint: int,
            budget: int = BATCH_BYTES) -> Iterator[tuple[bytes, list[BlockKey]]]:
    """The wire messages of the ``(key, record)`` pairs, several pieces to a message up to ``budget`` bytes (always at
    least one piece; ``budget`` 0: one per message), each with the keys of the blocks it completes. A message of one
    piece is that piece (a record as it is); a message of several is one ``BlockPiece`` with the others in ``next``."""
    parts: list[bytes] = []
    keys: list[BlockKey] = []
    size = 0
    for key, record in records:
        for piece in record_pieces(key, record, spec_fingerprint):
            if parts and size + _NEXT_FIELD_BYTES + len(piece) > budget:
                yield (parts[0] if len(parts) == 1 else b"".join(parts)), keys
                parts, keys, size = [], [], 0
            if parts:
                parts += (_NEXT_TAG, varint(len(piece)))
                size += _NEXT_FIELD_BYTES
            parts.append(piece)
            size += len(piece)
        keys.append(key)
    if parts:
        yield (parts[0] if len(parts) == 1 else b"".join(parts)), keys


class Piece(NamedTuple):
    """One parsed ``BlockPiece``: ``data`` is a view into the received bytes, starting at ``data_start``."""

    key: BlockKey
    offset: int
    frame_bytes: int
    data: memoryview
    spec_fingerprint: int
    data_start: int


def _read_varint(raw: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(raw) or shift > 63:
            raise ValueError("malformed piece: truncated or overlong varint")
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFF_FFFF_FFFF_FFFF, at
        shift += 7


def parse_piece(raw: bytes | memoryview) -> Piece:
    """The fields of a ``BlockPiece`` from its wire bytes (any field order; unknown fields skipped); ValueError if
    the bytes are not a well-formed message or carry further pieces (``next``: see ``parse_message``)."""
    piece, first_next, _ = _parse(raw)
    if first_next is not None:
        raise ValueError("malformed piece: a piece inside a message carries further pieces")
    return piece


def parse_message(raw: bytes) -> list[tuple[Piece, bytes | memoryview]]:
    """The pieces of one streamed message, in order, each with its own wire bytes (the message itself when it holds
    one piece, else views into it); ValueError if it is malformed, or a field of the first piece follows its
    ``next`` pieces (a batch puts them last, so the first piece's bytes are a prefix of the message)."""
    first, first_next, spans = _parse(raw)
    if first_next is None:
        return [(first, raw)]
    view = memoryview(raw)
    pieces = [(first, view[:first_next])]
    for start, end in spans:
        pieces.append((parse_piece(view[start:end]), view[start:end]))
    return pieces


def _parse(raw: bytes | memoryview) -> tuple[Piece, int | None, list[tuple[int, int]]]:
    """The first piece's fields, where its first ``next`` field starts (None if none) and the spans of the pieces
    in ``next``."""
    fields = {TAG_KEY: 0, TAG_OFFSET: 0, TAG_FRAME_BYTES: 0, TAG_SPEC: 0}
    data_start = data_end = 0
    first_next = None
    spans: list[tuple[int, int]] = []
    at, end = 0, len(raw)
    while at < end:
        field_start = at
        tag, at = _read_varint(raw, at)
        wire_type = tag & 7
        if wire_type == 0:
            value, at = _read_varint(raw, at)
            if tag in fields:
                fields[tag] = value
        elif wire_type == 2:
            length, at = _read_varint(raw, at)
            if at + length > end:
                raise ValueError("malformed piece: a field runs past the end of the message")
            if tag == TAG_NEXT:
                if first_next is None:
                    first_next = field_start
                spans.append((at, at + length))
                at += length
                continue
            if tag == TAG_DATA:
                data_start, data_end = at, at + length
            at += length
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"malformed piece: wire type {wire_type}")
        if first_next is not None:
            raise ValueError("malformed message: a field of its first piece follows the pieces batched after it")
    if at != end:
        raise ValueError("malformed piece: a field runs past the end of the message")
    data = memoryview(raw)[data_start:data_end]
    piece = Piece(fields[TAG_KEY], fields[TAG_OFFSET], fields[TAG_FRAME_BYTES], data, fields[TAG_SPEC], data_start)
    return piece, first_next, spans


class RecordAssembler:
    """Rebuilds records of the pool's one frame size from in-order pieces, one block at a time.

    A piece holding a whole frame laid out as a record (what a Mooncake peer sends) is that record: no copy. Any
    other frame is gathered into one buffer reused for every block of the transfer: a fresh multi-MiB object per
    block would take fresh pages from the kernel each time (glibc maps allocations of that size anew), which
    measured slower than the network. That buffer is valid until the next ``add``; the pool copies what it stores.
    """

    def __init__(self, spec: BlockSpec) -> None:
        self.spec = spec
        self.frame_bytes = frame_size(spec)
        self.pending_key: BlockKey | None = None
        self._buffer: bytearray | None = None
        self._received = 0

    def add(self, piece: Piece, raw: bytes) -> bytes | bytearray | None:
        """Take one piece (``raw``: its wire bytes); returns the record when this piece completes a frame.
        ValueError if the piece does not follow on from the previous one."""
        key, offset, data = piece.key, piece.offset, piece.data
        if piece.frame_bytes != self.frame_bytes:
            raise ValueError(
                f"block {key:#018x}: frame of {piece.frame_bytes} bytes, this pool's blocks take {self.frame_bytes}"
            )
        if self.pending_key is not None and key != self.pending_key:
            raise ValueError(f"block {key:#018x} started before block {self.pending_key:#018x} was complete")
        if offset != self._received:
            raise ValueError(f"block {key:#018x}: piece at offset {offset}, expected {self._received}")
        end = offset + len(data)
        if not data or end > self.frame_bytes:
            raise ValueError(f"block {key:#018x}: piece of {len(data)} bytes at {offset} does not fit the frame")
        if offset == 0 and end == self.frame_bytes:
            if (
                piece.data_start == PREFIX_BYTES
                and len(raw) == PREFIX_BYTES + end
                and raw[:PREFIX_BYTES] == record_prefix(self.spec, key)
            ):
                return raw  # already the record
        if self._buffer is None:
            self._buffer = bytearray(PREFIX_BYTES + self.frame_bytes)
        if offset == 0:
            self._buffer[:PREFIX_BYTES] = record_prefix(self.spec, key)
        self._buffer[PREFIX_BYTES + offset : PREFIX_BYTES + end] = data
        if end < self.frame_bytes:
            self.pending_key, self._received = key, end
            return None
        self.pending_key, self._received = None, 0
        return self._buffer

    def records(self, raw: bytes) -> list[tuple[BlockKey, bytes | bytearray | memoryview]]:
        """The ``(key, record)`` of every block that message ``raw`` completes, in order (none while a large frame's
        pieces are still coming); ValueError as ``add``. A message of whole records of this pool's spec, as this
        build's senders join them, is read by checking each record's prefix (``whole_records``); any other message
        by parsing its pieces one by one."""
        whole = self.whole_records(raw)
        if whole is not None:
            return whole
        done = []
        for piece, piece_raw in parse_message(raw):
            record = self.add(piece, piece_raw)
            if record is not None:
                # the reused buffer is valid until the next add: a hostile message completing two large frames
                # must not hand on one buffer twice
                done.append((piece.key, bytes(record) if record is self._buffer else record))
        return done

    def whole_records(self, raw: bytes) -> list[tuple[BlockKey, memoryview | bytes]] | None:
        """The records of ``raw`` when it is exactly whole records of this spec (one, or several each behind its
        ``next`` field's tag and length), each a view into it (a message of one record: ``raw`` itself); None for
        any other message, which ``records`` parses piece by piece.

        A record prefix pins every field of its piece (key, frame size, spec fingerprint, padding, data tag and
        length: ``frame.record_prefix``), so a message whose records each start with the prefix of the key they
        name, separated by the ``next`` tag and length of one record, is read as the field-by-field parse and the
        assembler would read it, with one varint and one 64-byte comparison per record instead of a dozen fields
        parsed in Python (a 16-token block's receive was about a third Python). Nothing is accepted here that the
        full parse would refuse, and a message that fails any check is left to it for its error."""
        if self.pending_key is not None:
            return None
        record_size = PREFIX_BYTES + self.frame_bytes
        separator = next_separator(record_size)
        end, step = len(raw), record_size + len(separator)
        if end < record_size or (end + len(separator)) % step:
            return None
        if end == record_size:
            if raw[0] != TAG_KEY:
                return None
            key = _read_varint(raw, 1)[0]
            return [(key, raw)] if raw[:PREFIX_BYTES] == record_prefix(self.spec, key) else None
        view = memoryview(raw)
        found = []
        for at in range(0, end, step):
            if raw[at] != TAG_KEY:
                return None
            key = _read_varint(raw, at + 1)[0]
            if view[at : at + PREFIX_BYTES] != record_prefix(self.spec, key):
                return None
            if at + record_size < end and view[at + record_size : at + step] != separator:
                return None
            found.append((key, view[at : at + record_size]))
        return found
