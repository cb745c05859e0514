"""What every simulated cluster shares: arrivals from the trace, load sampling, the progress bar, the result.

A cluster subclass implements ``on_arrival(request)`` (route it, or reject it) and ``sample_load()``; everything
else it does by scheduling callbacks on ``self.events``. The run ends when no event is left.
"""

from __future__ import annotations

import math
import time

from mooncake_jax.sim.config import SimConfig
from mooncake_jax.sim.events import EventQueue
from mooncake_jax.sim.metrics import SimResult, summarize
from mooncake_jax.sim.records import PENDING, LoadLog, SimRequest
from mooncake_jax.sim.trace import Trace


class ClusterSim:
    """Base of the disaggregated and coupled clusters: drives arrivals and sampling on one virtual clock."""

    def __init__(self, config: SimConfig, trace: Trace, observer=None, progress: bool = False):
        if len(trace) == 0:
            raise ValueError("the trace has no requests")
        self.config = config
        self.trace = trace
        self.block = trace.block_tokens
        self.start = trace[0].timestamp_s
        self.events = EventQueue(self.start, observer)
        self.requests = [SimRequest(i, r.timestamp_s, r.input_length, r.output_length, r.hash_ids)
                         for i, r in enumerate(trace)]
        self.load = LoadLog(config.sample_interval_s)
        self._progress = progress
        self._bar = None

    # ---------------------------------------------------------------------------------------- subclass API

    def on_arrival(self, request: SimRequest) -> None:
        raise NotImplementedError

    def sample_load(self) -> dict[str, float]:
        raise NotImplementedError

    def cost_per_hour(self) -> float:
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------- running

    def run(self) -> SimResult:
        wall = time.perf_counter()
        if self._progress:
            from tqdm import tqdm

            self._bar = tqdm(total=len(self.requests), desc=f"simulate {self.trace.name}", unit="req",
                             mininterval=0.5, smoothing=0.1)
        self.events.at(self.start, self._arrive, 0)
        self.events.at(self.start, self._sample)
        try:
            while len(self.events):
                self.events.run_next()
        finally:
            if self._bar is not None:
                self._bar.close()
        wall_s = time.perf_counter() - wall
        unfinished = [r.request_id for r in self.requests if r.status == PENDING]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} requests never ended (first: {unfinished[:5]})")
        ends = [r.finished_at for r in self.requests if not math.isnan(r.finished_at)]
        end = max(ends) if ends else self.start  # the last request's end (load samples may tick on after it)
        cfg = self.config
        summary = summarize(self.requests, ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s,
                            block_tokens=self.block, duration_s=end - self.start, wall_s=wall_s,
                            cost_per_hour=self.cost_per_hour())
        summary.update(self.extra_summary())
        return SimResult(summary, self.requests, self.load.series, cfg.to_dict(), self.trace.name)

    def extra_summary(self) -> dict:
        return {}

    def _arrive(self, index: int) -> None:
        request = self.requests[index]
        self.on_arrival(request)
        if index + 1 < len(self.requests):
            self.events.at(self.requests[index + 1].arrival, self._arrive, index + 1)
        if self._bar is not None and (index % 256 == 255 or index + 1 == len(self.requests)):
            self._bar.update(index + 1 - self._bar.n)

    def _sample(self) -> None:
        values = self.sample_load()
        self.load.add(time_s=self.events.now - self.start, **values)
        if len(self.events):  # something else is still to happen
            self.events.at(self.events.now + self.load.interval_s, self._sample)
