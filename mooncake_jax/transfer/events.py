"""Stored/removed notifications: what the Conductor's global block index consumes as KV events."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_jax.blocks import BlockKey


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class BlockEvent:
    """``key`` entered (STORED) or left (REMOVED) ``tier`` (``"dram"`` or ``"ssd"``).

    A block is in the pool while at least one tier holds it: demotion is REMOVED from dram plus STORED on ssd
    (in that order: ssd STORED first, so a listener never sees the block absent while it moves).
    """

    kind: EventKind
    key: BlockKey
    tier: str


EventListener = Callable[[BlockEvent], None]
