"""The disaggregated cluster: prefill and decode pools driven by the Conductor's own ``ClusterState`` and ``Policy``.

Per request, what a real cluster does, on the virtual clock:

1. Arrival: ``ClusterState.schedule`` decides (the same call the gRPC service makes; its TTFT check against the
   prefill's budget, ``accounting.prefill_budget_s``, under this simulator's release timing). A rejection is
   *early*.
2. A planned prefix fetch starts at once on the NICs (sender's outgoing and receiver's incoming link, each a
   FIFO, so a hot sender congests); the fetched blocks are held for the request, not put in the cache yet.
3. Prefill, FIFO per instance, one request at a time: it starts when the instance is free and its fetch has
   landed, reuses the longest prefix it then holds (own cache plus fetched blocks: evictions since the decision
   count), and takes the cost model's time for the rest. Its KV streams to the decode instance layer by layer
   during the prefill (the link is reserved from the start; the KV is there when both prefill and stream end), or
   is pushed after it (``SimConfig.release_timing``, the one accounting in ``conductor/accounting.py``).
4. Prefill end: first token (or, released after the push, when the KV has arrived); the prompt's blocks enter
   the instance's cache (evictions and stores are reported as KV events); ``prefill_done`` is reported, with the
   instance's queued work (a heartbeat).
5. KV arrival at decode (plus ``SimConfig.decode_join_s``, the decode instance's own time to take the request
   in, one request at a time: its RPC, staging the KV from its pool, loading it into pages, the last of which
   stalls its running batch, ``decode_join_stall_s``): the decode side's own check (``decode_accepts``) may reject
   it *late*, wasting the prefill; otherwise it joins the continuous batch at the next iteration boundary
   (``batch.ContinuousBatch``) and ``decode_started`` / ``finished`` are reported, which feeds the Conductor's
   tracked decode time.

With ``admission="none"`` nothing is rejected: a request whose KV does not fit waits for room (FIFO).
"""

from __future__ import annotations

from collections import deque

from mooncake_jax.conductor import ClusterState, Policy, Request, decode_accepts
from mooncake_jax.conductor.accounting import prefill_work_s, reused_tokens
from mooncake_jax.conductor.costs import transfer_seconds
from mooncake_jax.sim.batch import ContinuousBatch
from mooncake_jax.sim.cache import make_cache
from mooncake_jax.sim.host import paired_rate, rates_with_streaming
from mooncake_jax.slo import tbt_of_gaps
from mooncake_jax.sim.records import COMPLETED, REJECTED_EARLY, REJECTED_LATE, SimRequest
from mooncake_jax.sim.runner import ClusterSim


class _Node:
    """What every instance has: an id, its costs, and the two directions of its NIC (each a FIFO link)."""

    def __init__(self, instance_id: str, costs):
        self.id = instance_id
        self.costs = costs
        self.out_free = 0.0
        self.in_free = 0.0


class PrefillNode(_Node):
    def __init__(self, instance_id: str, costs, cache):
        super().__init__(instance_id, costs)
        self.cache = cache
        self.queue: deque[SimRequest] = deque()
        self.queued_s = 0.0  # predicted seconds of the queued (not yet started) requests
        self.running: SimRequest | None = None
        self.busy_until = 0.0
        # the running prefill on a shared host (SimConfig.host_cores): its cost-model seconds left as of rated_at,
        # the speed it runs at since then, and the version of its end event (a re-timed end voids the earlier one)
        self.work_left = 0.0
        self.rated_at = 0.0
        self.rate = 1.0
        self.end_version = 0
        self.computed_tokens = 0  # the running prefill's new tokens (its slowdown beside another grows with them)


class DecodeNode(_Node):
    def __init__(self, instance_id: str, costs, capacity_tokens: int, step_spread: tuple[float, ...] = (),
                 seed: int = 0):
        super().__init__(instance_id, costs)
        self.batch = ContinuousBatch(costs.decode, capacity_tokens, step_spread, seed)
        self.waiting: deque[SimRequest] = deque()
        self.version = 0
        self.join_free_at = 0.0  # when it can start taking in the next request (SimConfig.decode_join_s)


class DisaggregatedSim(ClusterSim):
    """Prefill pool + decode pool + the Conductor's state and policy (see the module docstring)."""

    def __init__(self, config, trace, observer=None, progress: bool = False):
        super().__init__(config, trace, observer, progress)
        policy_config = config.policy_config(self.block)
        self.state = ClusterState(policy_config)
        # the Conductor's policy, admitting on the prefill's TTFT budget as this cluster releases first tokens
        self.policy = Policy(policy_config, timing=config.release_timing, off_engine_s=config.prefill_off_engine_s)
        self.admission = policy_config.admission.value
        prefill_costs, decode_costs = config.pool_costs()
        per_node = config.cache_blocks(self.block)
        self.global_cache = config.cache_mode == "global"
        shared = make_cache(config.eviction, None if per_node is None else per_node * config.prefill)
        self.prefill = []
        for i in range(config.prefill):
            cache = shared if self.global_cache else make_cache(config.eviction, per_node)
            self.prefill.append(PrefillNode(f"p{i}", prefill_costs[i], cache))
        self.decode = [DecodeNode(f"d{j}", decode_costs[j], decode_costs[j].kv_capacity_tokens,
                                  config.decode_step_spread, config.seed + j) for j in range(config.decode)]
        self.by_id = {node.id: node for node in self.prefill + self.decode}
        for node in self.prefill:
            self.state.add_instance(node.id, "prefill", node.costs, self.start)
        for node in self.decode:
            self.state.add_instance(node.id, "decode", node.costs, self.start)
        self.transferred_bytes = 0.0
        self._sharing = False  # _host_load_changed is running (its decode advances may call it again)

    def cost_per_hour(self) -> float:
        return sum(node.costs.cost_per_hour for node in self.by_id.values())

    def extra_summary(self) -> dict:
        return {"transferred_gb": self.transferred_bytes / 1e9,
                "peak_decode_kv_fraction": max(d.batch.peak_reserved / d.batch.capacity for d in self.decode)}

    # -------------------------------------------------------------------------------------------- arrival

    def on_arrival(self, req: SimRequest) -> None:
        now = self.events.now
        decision = self.state.schedule(self.policy, Request(req.request_id, req.keys, req.input_tokens,
                                                            req.output_tokens), now)
        if not decision.accepted:
            req.status, req.reason = REJECTED_EARLY, decision.reason.value
            self.load.rejected += 1
            return
        self.load.accepted += 1
        p, d = self.by_id[decision.prefill], self.by_id[decision.decode]
        req.prefill_id, req.decode_id = p.id, d.id
        req.predicted_prefill_s = decision.prefill_s
        if decision.transfer is not None:
            self._fetch(req, p, self.by_id[decision.transfer.source], decision.transfer.keys)
        p.queue.append(req)
        p.queued_s += req.predicted_prefill_s
        self._try_start(p)

    def _send(self, src: _Node, dst: _Node, ready: float, n_bytes: float) -> float:
        """Reserve both links for a transfer that may start at ``ready``; returns when it has arrived."""
        start = max(ready, src.out_free, dst.in_free)
        table = self.state.instances
        end = start + float(transfer_seconds(n_bytes, table.link(table.slot(src.id), table.slot(dst.id))))
        src.out_free = dst.in_free = end
        self.transferred_bytes += n_bytes
        return end

    def _fetch(self, req: SimRequest, p: PrefillNode, src: PrefillNode, keys: tuple[int, ...]) -> None:
        """Move the planned blocks ``src`` still holds; the request keeps them until its prefill starts."""
        now = self.events.now
        n = src.cache.prefix(keys)
        if n == 0:
            return
        src.cache.touch(keys[:n])
        end = self._send(src, p, now, n * self.block * p.costs.kv_bytes_per_token)
        req.staged = frozenset(keys[:n])
        req.fetched_blocks = n
        req.fetch_ready_at = end
        self.state.heartbeat(src.id, now, send_backlog_s=src.out_free - now)
        self.events.at(end, self._try_start, p)

    # -------------------------------------------------------------------------------------------- prefill

    def _try_start(self, p: PrefillNode) -> None:
        if p.running is not None or not p.queue or p.queue[0].fetch_ready_at > self.events.now:
            return
        req = p.queue.popleft()
        p.queued_s = max(p.queued_s - req.predicted_prefill_s, 0.0) if p.queue else 0.0  # no drift below zero
        self._start_prefill(p, req)

    def _start_prefill(self, p: PrefillNode, req: SimRequest) -> None:
        now, n, keys = self.events.now, req.input_tokens, req.keys
        cache, staged = p.cache, req.staged
        if staged:
            prefix = 0
            for key in keys:
                if key not in cache and key not in staged:
                    break
                prefix += 1
        else:
            prefix = cache.prefix(keys)
        cache.touch(keys[:prefix])
        reused = reused_tokens(n, prefix * self.block)
        compute = prefill_work_s(p.costs.prefill, n, reused) * self._prefill_slowdown(now)
        duration = compute + self.config.request_overhead_s
        if self.global_cache and reused:  # the pool is spread over all nodes: load it over the NIC, layer-wise
            duration = max(compute, reused * p.costs.kv_bytes_per_token / p.costs.nic_bytes_per_s)
        req.prefill_start, req.prefill_s = now, compute
        req.prefix_blocks, req.prefix_tokens = prefix, min(prefix * self.block, n)
        p.running, p.busy_until = req, now + duration
        p.computed_tokens = n - reused
        p.work_left, p.rated_at, p.rate = duration, now, 1.0
        p.end_version += 1
        timing = self.config.release_timing
        released = p.busy_until + self.config.prefill_off_engine_s  # its path off the engine (RPCs, staging, store)
        req.kv_ready_at = released
        if req.output_tokens > 1 and timing.push_start(now, released) <= now:  # streamed from now on
            self._push(p, req, now)
        self.state.heartbeat(p.id, now, queued_s=duration + p.queued_s,
                             send_backlog_s=max(p.out_free - now, 0.0))
        self.events.at(p.busy_until, self._prefill_end, p, req, p.end_version)
        self._host_load_changed()

    def _prefill_slowdown(self, now: float) -> float:
        """The measured factor on the cost model's prefill time for a prefill starting ``now``
        (``SimConfig.prefill_slowdown_steps``)."""
        factor = 1.0
        for from_s, step_factor in self.config.prefill_slowdown_steps:
            if from_s > now:
                break
            factor = step_factor
        return factor

    def _push(self, p: PrefillNode, req: SimRequest, ready: float) -> None:
        """Book the request's KV on the links to its decode instance from ``ready`` on (links are FIFOs in booking
        order, so a push is booked when it may start: at the prefill's start when streamed layer by layer, at its
        end when pushed after it; booked at a long prefill's start, a push after it would hold the decode
        instance's link against every shorter prefill that ends first)."""
        stream_end = self._send(p, self.by_id[req.decode_id], ready, req.input_tokens * p.costs.kv_bytes_per_token)
        req.kv_ready_at = max(req.kv_ready_at, stream_end)

    def _prefill_end(self, p: PrefillNode, req: SimRequest, version: int) -> None:
        if version != p.end_version:  # re-timed since (the host's load changed): a later event ends it
            return
        now = self.events.now
        released = now + self.config.prefill_off_engine_s
        req.kv_ready_at = max(req.kv_ready_at, released)  # later than planned at its start when it was stretched
        push_at = self.config.release_timing.push_start(req.prefill_start, released)
        if req.output_tokens > 1 and push_at > req.prefill_start:  # pushed after the prefill: booked now
            self._push(p, req, push_at)
        req.first_token_at = self.config.release_timing.first_token_at(now + self.config.prefill_off_engine_s,
                                                                       req.kv_ready_at)
        req.staged = frozenset()
        p.running = None
        evicted = p.cache.insert(req.keys)
        for node in (self.prefill if self.global_cache else (p,)):
            if evicted:
                self.state.kv_removed(node.id, evicted)
            self.state.kv_stored(node.id, req.keys)
        self.state.prefill_done(req.request_id, now)
        self.state.heartbeat(p.id, now, queued_s=p.queued_s, send_backlog_s=max(p.out_free - now, 0.0))
        if req.output_tokens == 1:
            req.status, req.finished_at = COMPLETED, req.first_token_at
            self.state.finished(req.request_id, now)
        else:
            # the decode instance takes the request into its batch decode_join_s after its KV is there (and
            # decode_join_per_request_s for each request its batch runs then), the last decode_join_stall_s of it
            # on its engine loop (``_join``), one request at a time
            cfg, d = self.config, self.by_id[req.decode_id]
            join_s = (cfg.decode_join_s + cfg.decode_join_per_request_s * d.batch.batch) * self._join_stretch(d)
            taken_in = req.kv_ready_at + join_s
            if join_s:
                taken_in = max(req.kv_ready_at, d.join_free_at) + join_s
                d.join_free_at = taken_in
            self.events.at(taken_in - cfg.decode_join_stall_s, self._kv_arrived, d, req)
        self._try_start(p)
        self._host_load_changed()

    def _join_stretch(self, d: DecodeNode) -> float:
        """How much longer than ``decode_join_s`` a join booked now takes on a shared host (``SimConfig.host_cores``):
        the decode instance is busy taking the request in, so it counts with the prefills computing and the other
        decode instances decoding, as the host's load is when the join is booked (its KV's push, at the prefill's
        end; the part that stalls the batch, ``decode_join_stall_s``, is not stretched)."""
        if self.config.host_cores is None:
            return 1.0
        return 1.0 / self._host_rates([e for e in self.decode if e is d or e.batch.batch > 0])[1]

    def _host_rates(self, busy: list[DecodeNode]) -> tuple[float, float]:
        """``host.shared_rates`` on the configured host (``SimConfig.host_cores`` set) with the prefills computing
        now and the ``busy`` decode instances, and the streaming load of their batches' tokens
        (``SimConfig.decode_stream_cpu_s``: their batches' tokens a second at the cost model's steps,
        ``host.rates_with_streaming``): (each prefill's speed, each decode's speed)."""
        cfg = self.config
        tokens_per_s = 0.0
        if cfg.decode_stream_cpu_s:
            tokens_per_s = sum(d.batch.batch / d.batch.base_step_seconds() for d in busy if d.batch.batch)
        prefill, decode, _ = rates_with_streaming(cfg.host_cores, sum(p.running is not None for p in self.prefill),
                                                  len(busy), cfg.host_prefill_weight, cfg.host_other_busy,
                                                  tokens_per_s, cfg.decode_stream_cpu_s)
        return prefill, decode

    def _host_busy(self) -> tuple:
        """What the host's sharing depends on in the decode pool: which batches are busy, and with the streaming
        load (``SimConfig.decode_stream_cpu_s``) how many requests each runs."""
        if self.config.decode_stream_cpu_s:
            return tuple(d.batch.batch for d in self.decode)
        return tuple(d.batch.batch > 0 for d in self.decode)

    def _host_load_changed(self) -> None:
        """Instances sharing one host. ``SimConfig.host_cores``: the busy instances (prefills computing, decode
        batches not empty) share the cores by weight (``host.shared_rates``), each slower than its cost model by
        its share: a running prefill's remaining work is re-timed now, decode steps from each batch's next
        boundary; beside another prefill each prefill's speed is divided by its length's factor
        (``SimConfig.host_pair_length_exponent``, ``host.paired_rate``). ``SimConfig.shared_host_decode_slowdown``
        (> 1): decode steps that much slower again while any prefill computes."""
        cores, slowdown = self.config.host_cores, self.config.shared_host_decode_slowdown
        if (cores is None and slowdown == 1.0) or self._sharing:
            return
        self._sharing = True
        try:
            changed = True
            while changed:  # a decode batch advanced to now may empty (one fewer busy): rate everything again
                changed = False
                now, prefilling = self.events.now, any(p.running is not None for p in self.prefill)
                stretch = 1.0
                if cores is not None:
                    prefill_rate, decode_rate = self._host_rates([d for d in self.decode if d.batch.batch > 0])
                    stretch = 1.0 / decode_rate
                    running = sum(p.running is not None for p in self.prefill)
                    for p in self.prefill:
                        rate = paired_rate(prefill_rate, p.computed_tokens, self.config.host_pair_length_exponent,
                                           running)
                        if p.running is not None and p.rate != rate:
                            p.work_left = max(0.0, p.work_left - (now - p.rated_at) * p.rate)
                            p.rated_at, p.rate = now, rate
                            p.busy_until = now + p.work_left / rate
                            p.end_version += 1
                            self.events.at(p.busy_until, self._prefill_end, p, p.running, p.end_version)
                factor = stretch * (slowdown if prefilling else 1.0)
                for d in self.decode:
                    if d.batch.slowdown != factor:
                        before = self._host_busy()
                        self._advance_to(d, now)
                        d.batch.set_slowdown(factor)
                        self._reschedule(d)
                        changed = changed or (cores is not None and before != self._host_busy())
        finally:
            self._sharing = False

    # --------------------------------------------------------------------------------------------- decode

    def _kv_arrived(self, d: DecodeNode, req: SimRequest) -> None:
        b = d.batch
        self._advance_to(d, self.events.now)
        kv = req.input_tokens + req.output_tokens
        if self.admission == "none":
            accepted = kv <= b.capacity  # a request no instance could ever hold is the one thing refused
        else:
            accepted = decode_accepts(d.costs.decode, b.batch, b.reserved, kv, self.config.tbt_slo_s, b.capacity)
        if not accepted:
            req.status, req.reason = REJECTED_LATE, "decode_rejected"
            req.finished_at = b.time
            self.state.dropped(req.request_id)
            self.load.rejected += 1
        elif d.waiting or not b.fits(kv):
            d.waiting.append(req)
        else:
            self._join(d, req)
        self._reschedule(d)

    def _join(self, d: DecodeNode, req: SimRequest) -> None:
        b = d.batch
        if self.config.decode_join_stall_s:  # the KV loaded into pages on the engine loop: the batch waits
            b.stall(self.config.decode_join_stall_s)
        b.join(req, req.input_tokens, req.input_tokens + req.output_tokens, req.output_tokens - 1,
               req.first_token_at)
        self.state.decode_started(req.request_id, b.time)
        if self.config.host_cores is not None and (b.batch == 1 or self.config.decode_stream_cpu_s):
            self._host_load_changed()  # one more busy instance on the host, or one more request streaming

    def _advance_to(self, d: DecodeNode, when: float) -> None:
        b = d.batch
        if not b.batch:
            b.idle_until(when)
            return
        self._finished(d, b.advance(b.steps_until(when)))

    def _finished(self, d: DecodeNode, done: list[SimRequest]) -> None:
        b = d.batch
        for req in done:
            req.status = COMPLETED
            req.tbt_s = tbt_of_gaps(b.gaps(req))
            self.state.finished(req.request_id, req.finished_at)
        while d.waiting and b.fits(d.waiting[0].input_tokens + d.waiting[0].output_tokens):
            self._join(d, d.waiting.popleft())
        if self.config.host_cores is not None and done and (not b.batch or self.config.decode_stream_cpu_s):
            self._host_load_changed()  # one fewer busy instance on the host, or fewer requests streaming

    def _reschedule(self, d: DecodeNode) -> None:
        """Put the batch's next finish on the clock (any earlier plan is void)."""
        d.version += 1
        b = d.batch
        k = b.steps_to_finish()
        if k is not None:
            self.events.at(b.time + b.duration(k), self._decode_finish, d, d.version, k)

    def _decode_finish(self, d: DecodeNode, version: int, k: int) -> None:
        if version != d.version:
            return
        self._finished(d, d.batch.advance(k))
        self._reschedule(d)

    # ----------------------------------------------------------------------------------------------- load

    def sample_load(self) -> dict[str, float]:
        now = self.events.now
        n_p, n_d = len(self.prefill), len(self.decode)
        return {
            "prefill_queue_s": sum(p.queued_s + max(p.busy_until - now, 0.0) for p in self.prefill) / n_p,
            "prefill_busy": sum(p.running is not None for p in self.prefill) / n_p,
            "decode_kv": sum(d.batch.reserved / d.batch.capacity for d in self.decode) / n_d,
            "decode_batch": sum(d.batch.batch for d in self.decode) / n_d,
        }
