"""What the simulator remembers about each request and about load over time.

One ``SimRequest`` per trace request carries its milestones as the cluster sets them; ``metrics`` turns the
finished list into figures. ``LoadLog`` samples both pools at a fixed virtual-time interval (for the plots of
load over time, where early rejection's anti-phase oscillation shows).
"""

from __future__ import annotations

import math


PENDING = "pending"
COMPLETED = "completed"
REJECTED_EARLY = "rejected_early"
REJECTED_LATE = "rejected_late"


class SimRequest:
    """One request's journey. Times are on the virtual clock (trace seconds / speed); NaN means never reached.

    ``prefix_blocks``/``prefix_tokens``: cached prefix the prefill reused; ``prefill_s``: compute time spent on
    it (wasted when it is rejected late); ``tbt_s``: mean of its longest 10% token gaps (NaN with one token).
    """

    __slots__ = ("index", "request_id", "arrival", "input_tokens", "output_tokens", "keys", "status", "reason",
                 "prefill_id", "decode_id", "predicted_prefill_s", "staged", "fetch_ready_at", "fetched_blocks",
                 "prefill_start", "prefill_s", "prefix_blocks", "prefix_tokens", "first_token_at", "kv_ready_at",
                 "seg_start", "seg_end", "join_wait_s", "decode_start_at", "finished_at", "tbt_s", "node",
                 "prefilled_tokens")

    def __init__(self, index: int, arrival: float, input_tokens: int, output_tokens: int, keys: tuple[int, ...]):
        self.index = index
        self.request_id = f"r{index}"
        self.arrival = arrival
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.keys = keys
        self.status = PENDING
        self.reason = ""
        self.prefill_id = self.decode_id = None
        self.predicted_prefill_s = 0.0
        self.staged: frozenset[int] = frozenset()
        self.fetch_ready_at = -math.inf
        self.fetched_blocks = 0
        self.prefill_start = self.first_token_at = self.kv_ready_at = math.nan
        self.decode_start_at = self.finished_at = self.tbt_s = math.nan
        self.prefill_s = 0.0
        self.prefix_blocks = self.prefix_tokens = 0
        self.seg_start = self.seg_end = 0
        self.join_wait_s = 0.0
        self.node = None
        self.prefilled_tokens = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.arrival


class LoadLog:
    """Load of both pools sampled every ``interval_s``.

    Per sample: ``prefill_queue_s`` (mean seconds of prefill work queued or running per prefill instance),
    ``prefill_busy`` (fraction of prefill instances computing), ``decode_kv`` (mean fraction of decode KV capacity
    reserved), ``decode_batch`` (mean running requests per decode instance), and the requests ``accepted`` and
    ``rejected`` (early + late) since the previous sample.
    """

    FIELDS = ("time_s", "prefill_queue_s", "prefill_busy", "decode_kv", "decode_batch", "accepted", "rejected")

    def __init__(self, interval_s: float):
        if not interval_s > 0:
            raise ValueError(f"sample interval must be positive, got {interval_s!r}")
        self.interval_s = interval_s
        self.series: dict[str, list[float]] = {name: [] for name in self.FIELDS}
        self.accepted = self.rejected = 0

    def add(self, **values: float) -> None:
        values.update(accepted=self.accepted, rejected=self.rejected)
        for name in self.FIELDS:
            self.series[name].append(float(values[name]))
        self.accepted = self.rejected = 0
