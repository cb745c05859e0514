"""Continuous batching on one instance, advanced in closed form between batch changes.

Every iteration generates one token for each running request, and a step over ``B`` requests holding ``C`` KV
tokens takes ``c0 + c1*B + c2*C`` (the decode cost model). Between two changes of the batch (a request joins
or finishes) ``C`` grows by ``B`` per step, so the step times form an arithmetic sequence and ``k`` steps take
``k*(c0 + c1*B + c2*C) + c2*B*k*(k-1)/2``: the simulator jumps over a whole run of steps at once instead of
simulating a million iterations one by one.

Each run of steps is logged as a *segment* (lead, base, inc, count): ``count`` token gaps ``base + inc*j``, the
first one lengthened by ``lead`` (time the batch stood still before it, e.g. a coupled node prefilling). A
request runs through a contiguous range of segments, so its token gaps (and its TBT) come back exactly from the
log when it finishes.

A step's time can be a random variable (instances sharing a host's cores with others: the OS decides, step by
step, who runs). The clock advances by the cost model's (mean) step; with a measured ``step_spread`` (factors of
mean 1) each reported gap's step part is the mean step times a factor drawn from it, so the statistic of a
request's longest gaps (its TBT) sees the tail the real steps have, while its finish time stays the mean's.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from mooncake_jax.conductor import DecodeCost


class ContinuousBatch:
    """Running requests of one instance; its clock ``time`` is always at an iteration boundary.

    ``context``: KV tokens the next step reads. ``reserved``: KV tokens the running requests will hold when they
    end (input + output each), which is what admission checks against ``capacity`` so memory is never exceeded.
    A request joins with ``join(request, ...)`` and is handed back by ``advance`` once it has run its steps; the
    batch sets ``request.seg_start`` and ``request.seg_end`` (its segment range) and ``request.finished_at``.
    """

    def __init__(self, cost: DecodeCost, capacity_tokens: int, step_spread: tuple[float, ...] = (),
                 seed: int = 0):
        self._coef = cost.coef
        spread = np.asarray(step_spread, float)
        if spread.size and not (np.all(np.isfinite(spread)) and np.all(spread > 0)):
            raise ValueError(f"step_spread factors must be positive numbers, got {step_spread!r}")
        self.step_spread = spread / spread.mean() if spread.size else spread  # mean 1: the clock is the mean's
        self.seed = seed
        self.c0, self.c1, self.c2 = cost.coef
        self.slowdown = 1.0
        self.capacity = capacity_tokens
        self.time = 0.0
        self.step = 0
        self.batch = 0
        self.context = 0.0
        self.reserved = 0
        self.peak_reserved = 0
        self._finish: list[tuple] = []  # (finish step, seq, request, kv tokens reserved, context it leaves)
        self._seq = 0
        self._lead = 0.0
        self.seg_lead: list[float] = []
        self.seg_base: list[float] = []
        self.seg_inc: list[float] = []
        self.seg_count: list[int] = []

    # ---------------------------------------------------------------------------------------------- timing

    def step_seconds(self) -> float:
        return self.c0 + self.c1 * self.batch + self.c2 * self.context

    def base_step_seconds(self) -> float:
        """The next step's time at the cost model's speed (no ``slowdown``)."""
        c0, c1, c2 = self._coef
        return c0 + c1 * self.batch + c2 * self.context

    def duration(self, k: int) -> float:
        """Seconds the next ``k`` steps take with the current batch."""
        return k * self.step_seconds() + self.c2 * self.batch * k * (k - 1) / 2

    def steps_to_finish(self) -> int | None:
        """Steps until the next request finishes, or None when the batch is empty."""
        return self._finish[0][0] - self.step if self._finish else None

    def steps_until(self, when: float) -> int:
        """Fewest steps whose end is at or after ``when`` (0 if the clock is already there), never past the next
        finish: the boundary at which something arriving at ``when`` can join."""
        gap = when - self.time
        limit = self.steps_to_finish()
        if gap <= 0 or limit is None:
            return 0
        a = self.c2 * self.batch / 2
        b = self.step_seconds() - a
        k = gap / b if a <= 0 else (-b + math.sqrt(b * b + 4 * a * gap)) / (2 * a)
        k = max(0, min(limit, math.ceil(k)))
        while k > 0 and self.duration(k - 1) >= gap:
            k -= 1
        while k < limit and self.duration(k) < gap:
            k += 1
        return k

    # ----------------------------------------------------------------------------------------------- state

    def fits(self, kv_tokens: int) -> bool:
        return self.reserved + kv_tokens <= self.capacity

    def join(self, request, input_tokens: int, kv_tokens: int, steps: int, first_token_at: float) -> None:
        """``request`` starts decoding at the current boundary and leaves after ``steps`` steps.

        ``first_token_at``: when its previous token came out (its prefill's end), so its first gap is exact.
        """
        if steps < 1:
            raise ValueError("a request joins a decode batch to run at least one step")
        if not self.fits(kv_tokens):
            raise RuntimeError(f"batch would hold {self.reserved + kv_tokens} KV tokens, capacity {self.capacity}")
        self._flush_lead()
        self.batch += 1
        self.context += input_tokens
        self.reserved += kv_tokens
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._seq += 1
        heapq.heappush(self._finish, (self.step + steps, self._seq, request, kv_tokens, input_tokens + steps))
        request.seg_start = len(self.seg_count)
        request.join_wait_s = self.time - first_token_at
        request.decode_start_at = self.time

    def set_slowdown(self, factor: float) -> None:
        """From the current boundary on, every step takes ``factor`` times the cost model's time (the instance
        shares its host's cores with one that is computing now)."""
        self.slowdown = factor
        self.c0, self.c1, self.c2 = (c * factor for c in self._coef)

    def idle_until(self, when: float) -> None:
        """An empty batch's clock jumps forward (nothing runs, no gaps are logged)."""
        if self.batch:
            raise RuntimeError("idle_until on a running batch")
        self.time = max(self.time, when)
        self._lead = 0.0

    def stall(self, seconds: float) -> None:
        """The instance spends ``seconds`` on something else (a prefill): running requests wait for their next
        token that much longer."""
        self.time += seconds
        if self.batch:
            self._lead += seconds

    def advance(self, k: int, extra_s: float = 0.0) -> list:
        """Run ``k`` steps (at most up to the next finish); ``extra_s`` lengthens each of them (work done in the
        same iterations, e.g. prefill chunks). Returns the requests that finished, with ``seg_end`` and
        ``finished_at`` set."""
        if k <= 0:
            return []
        limit = self.steps_to_finish()
        if limit is None or k > limit:
            raise RuntimeError(f"advance({k}) past the next finish ({limit} steps)")
        self.seg_lead.append(self._lead)
        self.seg_base.append(self.step_seconds() + extra_s)
        self.seg_inc.append(self.c2 * self.batch)
        self.seg_count.append(k)
        self._lead = 0.0
        self.time += self.duration(k) + k * extra_s
        self.step += k
        self.context += k * self.batch
        done = []
        while self._finish and self._finish[0][0] == self.step:
            _, _, request, kv_tokens, context = heapq.heappop(self._finish)
            self.batch -= 1
            self.context -= context
            self.reserved -= kv_tokens
            request.seg_end = len(self.seg_count)
            request.finished_at = self.time
            done.append(request)
        if not self.batch:
            self.context = 0.0  # cancel floating drift
        return done

    def _flush_lead(self) -> None:
        """A stall before anyone decodes again is logged as an empty segment so it is charged to the requests
        running through it, not to one joining afterwards."""
        if self._lead and self.batch:
            self.seg_lead.append(self._lead)
            self.seg_base.append(0.0)
            self.seg_inc.append(0.0)
            self.seg_count.append(0)
        self._lead = 0.0

    # ------------------------------------------------------------------------------------------- token gaps

    def gaps(self, request) -> np.ndarray:
        """Every token gap of a finished request: time from its first token to its second, then between each
        following pair. With a ``step_spread`` each gap's step part is scaled by a factor drawn from it (seeded by
        the batch's seed and the request's ``index``, so a run is reproducible)."""
        lo, hi = request.seg_start, request.seg_end
        counts = np.asarray(self.seg_count[lo:hi], dtype=np.int64)
        base = np.asarray(self.seg_base[lo:hi])
        inc = np.asarray(self.seg_inc[lo:hi])
        lead = np.asarray(self.seg_lead[lo:hi])
        total = int(counts.sum())
        offsets = np.cumsum(counts) - counts
        j = np.arange(total) - np.repeat(offsets, counts)
        gaps = np.repeat(base, counts) + np.repeat(inc, counts) * j
        if self.step_spread.size:
            rng = np.random.default_rng((abs(int(self.seed)), abs(int(getattr(request, "index", 0)))))
            gaps *= rng.choice(self.step_spread, size=total)
        firsts = offsets[counts > 0]
        np.add.at(gaps, firsts, lead[counts > 0])
        # empty segments (stalls logged at a join) charge their lead to the next non-empty segment's first gap
        for i in np.flatnonzero(counts == 0):
            later = np.flatnonzero(counts[i + 1:] > 0)
            if later.size:
                gaps[offsets[i + 1 + later[0]]] += lead[i]
        gaps[0] += request.join_wait_s
        return gaps
