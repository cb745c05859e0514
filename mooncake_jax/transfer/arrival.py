"""A received message's records read and hashed on the thread that made the message, while it is in that core's cache.

grpcio turns every received message into a ``bytes`` on its polling thread (the server's, or a channel's for a
streamed reply: the message's slices copied into small ``bytes`` and joined) and hands it, on that same thread and
right after the join, to the method's deserializer. The receiver's end-to-end check hashed each record later, on the
thread that stores it, by which time the message had gone through a queue and another thread and was read from
memory: XXH3 of a 384 KiB record cost 0.11-0.13 CPU s/GB there against 0.03-0.04 right after the join (one process,
Intel Xeon (207), issue 15 fourteenth pass). So the Messenger's receiving methods deserialize with ``hashing``: a
message of whole records of the pool's spec (what this build sends, ``pieces.whole_records``) comes out as an
``Arrival``, its records as views into it and the XXH3-128 digest of each record's data taken there; the store
compares each digest with the checksum the record's head carries instead of hashing again (``BlockPool.put_records``
with ``digests``). What is checked is the same bytes (a ``bytes`` cannot change), so a damaged record is refused as
before. Any other message (a piece of a large frame, another spec, anything malformed) comes out as the ``bytes``
itself, for the assembler to read and the store to hash as before.

A deserializer must not raise (grpcio would end the call with INTERNAL): anything unexpected hands the message on
as it came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import xxhash

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import split_digest
from mooncake_jax.transfer.frame import DATA_OFFSET
from mooncake_jax.transfer.pieces import RecordAssembler, whole_records
from mooncake_jax.transfer.spec import BlockSpec


class Arrival(NamedTuple):
    """A received message of whole records: ``records`` as ``RecordAssembler.whole_records`` reads them (views into
    ``raw``, or ``raw`` itself for a message of one), ``digests`` the XXH3-128 ``(high, low)`` of each record's data,
    taken as the message arrived."""

    raw: bytes
    records: list[tuple[BlockKey, bytes | memoryview]]
    digests: list[tuple[int, int]]


def hashing(spec: BlockSpec) -> Callable[[bytes], bytes | Arrival]:
    """A gRPC deserializer for streamed messages of ``spec`` blocks: an ``Arrival`` for a message of whole records,
    else the message as it came (never raises)."""

    def arrive(raw: bytes) -> bytes | Arrival:
        try:
            records = whole_records(spec, raw)
            if records is None:
                return raw
            digests = [split_digest(xxhash.xxh3_128_intdigest(memoryview(record)[DATA_OFFSET:]))
                       for _, record in reversed(records)]  # the last record landed last: the most in cache
            digests.reverse()
            return Arrival(raw, records, digests)
        except Exception:  # noqa: BLE001 - the assembler reads the message again and reports what is wrong with it
            return raw

    return arrive


def received(assembler: RecordAssembler, item: bytes | Arrival
             ) -> tuple[list[tuple[BlockKey, bytes | bytearray | memoryview]], list[tuple[int, int]] | None]:
    """The records a received message (as ``hashing`` gave it) completes, and their digests if taken on arrival
    (None: the store hashes them): an ``Arrival`` between blocks is read as it was; else the message goes through
    ``assembler`` (ValueError as ``RecordAssembler.records``), which also reports an ``Arrival`` that came while a
    large frame's pieces were still due."""
    if type(item) is Arrival:
        if assembler.pending_key is None:
            return item.records, item.digests
        item = item.raw
    return assembler.records(item), None
