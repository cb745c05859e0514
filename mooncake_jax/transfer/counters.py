"""Counters the pool and the Messenger keep, as plain dataclasses a metrics exporter can read."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import asdict, dataclass


@dataclass
class TierCounters:
    """What happened in one tier since the pool opened.

    ``misses`` counts reads of keys the tier did not hold or held corrupt; ``corrupt`` counts blocks that failed
    their checksum (also removed from the tier); ``stale`` counts blocks of another record format version (dropped
    as misses, not corruption); ``demotions`` counts blocks moved from this tier to the next;
    ``promotions`` counts blocks copied into this tier from a slower one.
    """

    hits: int = 0
    misses: int = 0
    stored: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    corrupt: int = 0
    stale: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class TransferCounters:
    """Blocks and bytes a Messenger end moved, and the seconds its transfers took (for rates). ``blocks_refused``:
    received records that failed their checks on arrival (never stored; a pushed one is named to its sender, a
    fetched one asked for again, checked by the sender). ``socket_bytes``: the bytes of those that travelled on the
    socket data plane (either way); ``plane_fallbacks``: moves of a ``data_plane="auto"`` client that went over gRPC
    because the socket plane could not be used with that peer (an older build, a peer configured "grpc", TLS, a data
    port it could not reach)."""

    transfers: int = 0
    failures: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    blocks_skipped: int = 0
    blocks_refused: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    socket_bytes: int = 0
    plane_fallbacks: int = 0
    busy_s: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.busy_s if self.busy_s else 0.0

    @property
    def blocks_per_s(self) -> float:
        return (self.blocks_sent + self.blocks_received) / self.busy_s if self.busy_s else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "bytes_per_s": self.bytes_per_s, "blocks_per_s": self.blocks_per_s}


class Meter:
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
