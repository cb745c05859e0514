"""The coupled baseline: vLLM-like nodes that each prefill and decode, with and without chunked prefill.

A node runs one iteration at a time over its continuous batch (``batch.ContinuousBatch``), with a prefix cache
of the prompt blocks it computed, living in the HBM its running requests leave free (a request reserves its
whole KV, input + output, when its prefill starts; the cache shrinks to make room). Requests go to the node with
the fewest unfinished requests (a "least requests" load balancer), then wait FIFO on it.

- Without chunked prefill (prefill first, as vLLM's default scheduler without chunking): when the head of the
  queue fits in memory, the next iteration prefills as many queued requests as fit and as
  ``prefill_batch_tokens`` allows (at least one); every running request waits for it (the stall that inflates
  TBT). Otherwise the node decodes until a request arrives or finishes.
- With chunked prefill: each iteration carries every running decode plus up to ``chunk_tokens`` - (running
  requests) prompt tokens of the queued requests, in order; it takes the decode step's time plus the chunks'.

Pure decode stretches are advanced in closed form and cut at the first iteration boundary after an arrival,
exactly as on a disaggregated decode instance.
"""

from __future__ import annotations

from collections import deque

from mooncake_jax.sim.batch import ContinuousBatch
from mooncake_jax.sim.cache import make_cache
from mooncake_jax.sim.hardware import resolve_costs
from mooncake_jax.slo import tbt_of_gaps
from mooncake_jax.sim.records import COMPLETED, REJECTED_LATE, SimRequest
from mooncake_jax.sim.runner import ClusterSim


class CoupledNode:
    """One vLLM-like node: its batch, queue, chunked prefills in progress, and HBM prefix cache."""

    def __init__(self, node_id: str, costs, eviction: str, block: int):
        self.id = node_id
        self.costs = costs
        self.block = block
        self.batch = ContinuousBatch(costs.decode, costs.kv_capacity_tokens)
        self.cache = make_cache(eviction, costs.kv_capacity_tokens // block)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: deque[SimRequest] = deque()  # started, not done (chunked), in order
        self.prefill_reserved = 0  # KV reserved by requests in prefill, not yet in the batch
        self.version = 0
        self.pending = False  # an iteration or decode stretch is on the clock
        self.decoding = False  # ... and it is a pure decode stretch (an arrival may cut it)
        self.peak_memory = 0

    @property
    def unfinished(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.batch.batch

    def free_tokens(self) -> int:
        return self.batch.capacity - self.batch.reserved - self.prefill_reserved

    def can_admit(self) -> bool:
        """The queue's head would fit in memory now."""
        if not self.waiting:
            return False
        head = self.waiting[0]
        return head.input_tokens + head.output_tokens <= self.free_tokens()

    def admit(self, now: float) -> SimRequest:
        """Start the head's prefill: reserve its KV (shrinking the cache), find its cached prefix."""
        req = self.waiting.popleft()
        self.prefill_reserved += req.input_tokens + req.output_tokens
        self.cache.resize(self.free_tokens() // self.block)
        self.peak_memory = max(self.peak_memory, self.batch.capacity - self.free_tokens()
                               + len(self.cache) * self.block)
        prefix = self.cache.prefix(req.keys)
        self.cache.touch(req.keys[:prefix])
        req.prefill_start = now
        req.prefix_blocks, req.prefix_tokens = prefix, min(prefix * self.block, req.input_tokens)
        req.prefilled_tokens = min(prefix * self.block, req.input_tokens - 1)
        return req

    def chunk_seconds(self, req: SimRequest, tokens: int) -> float:
        done = req.prefilled_tokens
        return float(self.costs.prefill.seconds(done + tokens, done))


class CoupledSim(ClusterSim):
    """``prefill + decode`` coupled nodes (see the module docstring)."""

    def __init__(self, config, trace, observer=None, progress: bool = False):
        super().__init__(config, trace, observer, progress)
        costs = resolve_costs(config.hardware, config.model)
        self.nodes = [CoupledNode(f"n{i}", costs, config.eviction, self.block) for i in range(config.nodes)]
        self.chunked = config.chunked_prefill

    def cost_per_hour(self) -> float:
        return sum(node.costs.cost_per_hour for node in self.nodes)

    def extra_summary(self) -> dict:
        return {"transferred_gb": 0.0,
                "peak_decode_kv_fraction": max(n.batch.peak_reserved / n.batch.capacity for n in self.nodes),
                "peak_memory_fraction": max(n.peak_memory / n.batch.capacity for n in self.nodes)}

    def on_arrival(self, req: SimRequest) -> None:
        kv = req.input_tokens + req.output_tokens
        node = min(self.nodes, key=lambda n: n.unfinished)
        if kv > node.batch.capacity:
            req.status, req.reason, req.finished_at = REJECTED_LATE, "too_large", self.events.now
            self.load.rejected += 1
            return
        self.load.accepted += 1
        req.node = node.id
        node.waiting.append(req)
        if not node.pending:
            self._iterate(node, node.version)
        elif node.decoding and (node.prefilling or node.can_admit()):
            self._cut(node)

    def _cut(self, node: CoupledNode) -> None:
        """Stop a decode stretch at the first iteration boundary from now, and plan again there."""
        b = node.batch
        self._finished(node, b.advance(b.steps_until(self.events.now)))
        node.version += 1
        node.decoding = False
        self.events.at(b.time, self._iterate, node, node.version)

    def _iterate(self, node: CoupledNode, version: int) -> None:
        """Plan and apply the node's next iteration (or decode stretch) starting at its clock."""
        if version != node.version:
            return
        b = node.batch
        if not b.batch:
            b.idle_until(self.events.now)
        node.version += 1
        node.pending, node.decoding = True, False
        prefilled = self._chunked_iteration(node) if self.chunked else self._prefill_iteration(node)
        if prefilled is not None:
            for req in prefilled:
                self._first_token(node, req)
            self.events.at(b.time, self._iterate, node, node.version)
            return
        k = b.steps_to_finish()
        if k is None:
            node.pending = False
            return
        node.decoding = True
        self.events.at(b.time + b.duration(k), self._stretch_end, node, node.version, k)

    def _prefill_iteration(self, node: CoupledNode) -> list[SimRequest] | None:
        """Unchunked: prefill queued requests while they fit (the batch stalls); None when there is nothing."""
        if not node.can_admit():
            return None
        now, budget, spent, batch = node.batch.time, self.config.prefill_batch_tokens, 0.0, []
        while node.can_admit() and (not batch or node.waiting[0].input_tokens <= budget):
            req = node.admit(now)
            new = req.input_tokens - req.prefilled_tokens
            req.prefill_s = node.chunk_seconds(req, new)
            req.prefilled_tokens = req.input_tokens
            budget -= new
            spent += req.prefill_s
            batch.append(req)
        node.batch.stall(spent)
        return batch

    def _chunked_iteration(self, node: CoupledNode) -> list[SimRequest] | None:
        """Chunked: one iteration of all decodes plus prompt chunks; None when no prompt work is possible."""
        b = node.batch
        if not node.prefilling and not node.can_admit():
            return None
        budget = max(self.config.chunk_tokens - b.batch, 0)
        extra, done = 0.0, []
        while budget > 0:
            if not node.prefilling:
                if not node.can_admit():
                    break
                node.prefilling.append(node.admit(b.time))
            req = node.prefilling[0]
            take = min(budget, req.input_tokens - req.prefilled_tokens)
            seconds = node.chunk_seconds(req, take)
            req.prefill_s += seconds
            req.prefilled_tokens += take
            extra += seconds
            budget -= take
            if req.prefilled_tokens == req.input_tokens:
                done.append(node.prefilling.popleft())
        if b.batch:
            self._finished(node, b.advance(1, extra))
        else:
            b.stall(extra)
        return done

    def _first_token(self, node: CoupledNode, req: SimRequest) -> None:
        """A prefill finished in the iteration just applied: first token out, blocks cached, decoding next."""
        b = node.batch
        req.first_token_at = b.time
        kv = req.input_tokens + req.output_tokens
        node.prefill_reserved -= kv
        if req.output_tokens == 1:
            req.status, req.finished_at = COMPLETED, b.time
        else:
            b.join(req, req.input_tokens, kv, req.output_tokens - 1, b.time)
        node.cache.resize(node.free_tokens() // self.block)
        node.cache.insert(req.keys)

    def _stretch_end(self, node: CoupledNode, version: int, k: int) -> None:
        if version != node.version:
            return
        self._finished(node, node.batch.advance(k))
        self._iterate(node, node.version)

    def _finished(self, node: CoupledNode, done: list[SimRequest]) -> None:
        for req in done:
            req.status = COMPLETED
            req.tbt_s = tbt_of_gaps(node.batch.gaps(req))
        if done:
            node.cache.resize(node.free_tokens() // self.block)

    def sample_load(self) -> dict[str, float]:
        n = len(self.nodes)
        queued = sum(float(node.costs.prefill.seconds(r.input_tokens, 0)) for node in self.nodes
                     for r in node.waiting)
        return {
            "prefill_queue_s": queued / n,
            "prefill_busy": sum(bool(node.prefilling) for node in self.nodes) / n,
            "decode_kv": sum(node.batch.reserved / node.batch.capacity for node in self.nodes) / n,
            "decode_batch": sum(node.batch.batch for node in self.nodes) / n,
        }
