"""Stored/removed notifications: what the Conductor's global block index consumes as KV events.

They describe the pool as a whole, the way the index models an instance: a block is held in one tier, its
fastest. Copies kept in slower tiers (an SSD copy left behind by promotion) are the pool's business.
"""

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
    """STORED: ``key`` is now held with ``tier`` (``"dram"`` or ``"ssd"``) its fastest tier: it was stored,
    demoted (STORED ssd) or promoted (STORED dram). REMOVED: ``key`` left the pool; ``tier`` is where it was.

    A moving block is never announced absent: demotion writes the SSD copy before dropping the DRAM one.
    """

    kind: EventKind
    key: BlockKey
    tier: str


EventListener = Callable[[BlockEvent], None]
