"""What both ends of the Messenger share: the generated protobuf modules, the service name, how missing keys
are reported."""

from __future__ import annotations

from collections.abc import Sequence

from mooncake_jax.blocks import BlockKey
from mooncake_jax.proto import load

messages, services = load("messenger")

SERVICE = "mooncake.v1.Messenger"
MISSING_KEYS_METADATA = "mooncake-missing-keys-bin"
"""Trailing metadata of a NOT_FOUND: the missing keys as packed little-endian uint64 (at most MAX_LISTED_KEYS)."""
CORRUPT_KEYS_METADATA = "mooncake-corrupt-keys-bin"
"""Trailing metadata of a DATA_LOSS from a receiver: the key of the record that failed its checks on arrival, as a
packed little-endian uint64. A pusher sends its records unchecked (the receiver's check is end to end) and checks
its own copy of the named block when told (``MessengerClient.push``): a block damaged in its memory is dropped there."""
MAX_LISTED_KEYS = 512
_NAMED_IN_MESSAGE = 16


def describe_keys(keys: Sequence[BlockKey]) -> str:
    """Keys in hex for a message, the first few of a long list and a count of the rest."""
    named = ", ".join(f"{key:#018x}" for key in keys[:_NAMED_IN_MESSAGE])
    more = len(keys) - _NAMED_IN_MESSAGE
    return named + (f" and {more} more" if more > 0 else "")
