"""The messages that carry a pool's blocks to a peer, built ahead of the transport on a thread.

Both Messenger ends send this way (the server's Fetch, the client's Push), on a thread of their own, at most a few
messages ahead, so gRPC's thread only hands finished messages to the transport. Small blocks are joined several to
a message straight out of their slots (``BlockPool.join_records``: one copy, verified, where reading each record
then joining them copied twice), or, when they lie in one message kept as received, in the order asked, sent as
that message (verified where they lie, no copy); a block that fills a message alone is read as its record
(``get_record``) and sent as it is, or in pieces (``pieces.batched``).
A block that fails its checksum here (the pool drops it) ends the messages after the blocks before it, which are
still sent; ``lost`` then names it, for the caller to report once the stream is over. With ``verify=False`` (a
push: the receiver checks every record end to end, hashing it as it lands, and names one that fails,
``messenger_wire.CORRUPT_KEYS_METADATA``) the records go as stored, unchecked here: the sender's XXH3 pass over
every byte it sends is the receiver's instead, done once.

Blocks put together into a DRAM tier lie in message-shaped slot groups (``slots._Group``); asked for in the order
they were put, a group's own ``bytes`` is the message (``join_records(..., lend=True)``: no join copy, the sender's
one copy beyond the transport's), lent by the pool until gRPC has taken it. gRPC asks for the next message only
once it has sent the last (its send copies the ``bytes`` into its own buffer), so the loan ends when the consumer
comes back for the next message, or when this closes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.pieces import PIECE_BYTES, batched, next_separator, records_per_message
from mooncake_jax.transfer.pool import BlockPool
from mooncake_jax.transfer.readahead import Ahead


class Outgoing:
    """Iterates ``(message, keys it completes)`` for the blocks of ``keys`` in ``pool``, in order, several to a
    message up to ``batch_bytes`` (0: one piece per message, for a peer of an older build); ``verify=False``:
    records sent unchecked, for a receiver that checks them (module docstring)."""

    def __init__(self, pool: BlockPool, keys: Sequence[BlockKey], batch_bytes: int, depth: int = 4,
                 verify: bool = True) -> None:
        self.lost: BlockKey | None = None
        self._pool = pool
        self._verify = verify
        self._produced: list[bytes] = []  # messages made and not yet taken back from gRPC (some lent by the pool)
        self._produced_lock = threading.Lock()
        per_message = records_per_message(pool.frame_bytes, batch_bytes)
        if per_message > 1 or pool.frame_bytes <= PIECE_BYTES:  # records that travel whole
            messages = self._joined(list(keys), per_message)
        else:
            messages = batched(self._records(list(keys)), pool.spec.fingerprint, 0)
        self._ahead = Ahead(messages, depth, name="send-ahead")

    def _joined(self, keys: list[BlockKey], per_message: int) -> Iterator[tuple[bytes, list[BlockKey]]]:
        separator = next_separator(self._pool.record_bytes)
        at = 0
        while at < len(keys):
            group = keys[at : at + per_message]
            message, count = self._pool.join_records(group, separator, verify=self._verify, lend=True)
            if count:
                with self._produced_lock:
                    self._produced.append(message)
                yield message, group[:count]
                at += count
            if count < len(group):  # absent or corrupt in its fastest tier: the usual read tries the others
                record = self._pool.get_record(keys[at], promote=False, verify=self._verify)
                if record is None:
                    self.lost = keys[at]
                    return
                yield record, [keys[at]]
                at += 1

    def _records(self, keys: list[BlockKey]) -> Iterator[tuple[BlockKey, bytes]]:
        for key in keys:
            record = self._pool.get_record(key, promote=False, verify=self._verify)
            if record is None:  # failed its checksum just now (or lost from its tier): gone from the pool
                self.lost = key
                return
            yield key, record

    def __iter__(self) -> Iterator[tuple[bytes, list[BlockKey]]]:
        for message, keys in self._ahead:
            yield message, keys
            self._taken(message)  # asked for the next one: gRPC has sent (copied) this one

    def _taken(self, message: bytes) -> None:
        with self._produced_lock:
            for i, produced in enumerate(self._produced):
                if produced is message:
                    del self._produced[i]
                    break
            else:
                return
        self._pool.give_back(message)

    def close(self) -> None:
        """Stop making messages and end the pool's loans of those not taken back (gRPC is done with them: its
        consumer has stopped asking)."""
        self._ahead.close()
        with self._produced_lock:
            left, self._produced = self._produced, []
        for message in left:
            self._pool.give_back(message)

    def __enter__(self) -> Outgoing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
