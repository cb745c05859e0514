"""KVCache transfer: the block pool (a DRAM tier in slots of host memory, an SSD tier in slots of one file) and the
Messenger that moves blocks between instances' pools (over gRPC, or as device arrays with jax.experimental.transfer)."""

from mooncake_jax.transfer.counters import TierCounters, TransferCounters
from mooncake_jax.transfer.events import BlockEvent, EventKind
from mooncake_jax.transfer.eviction import EvictionPolicy, LFUPolicy, LRUPolicy
from mooncake_jax.transfer.frame import CorruptBlockError
from mooncake_jax.transfer.pool import BlockPool, PoolFullError
from mooncake_jax.transfer.spec import BlockSpec
from mooncake_jax.transfer.tiers import TierWriteError

__all__ = [
    "BlockEvent",
    "BlockPool",
    "BlockSpec",
    "CorruptBlockError",
    "EventKind",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PoolFullError",
    "TierCounters",
    "TierWriteError",
    "TransferCounters",
]
