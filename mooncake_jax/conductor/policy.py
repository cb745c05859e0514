"""The scheduling policy: a request and a snapshot in, a decision out (Algorithm 1 of the Mooncake paper).

``Policy.decide`` is pure: it reads the snapshot, never changes it, and gives the same decision for the same
request, snapshot and clock (``random`` draws from a generator seeded by the request id). Applying a decision
(counting the routed request's load at once) is the cluster state's job, so the gRPC service and the simulator
share every line of policy code.

One decision:

1. Prefix match of the prompt's block keys against every instance (one walk of the block index); the longest
   match anywhere is ``best_len`` on ``best_instance`` (ties: the least busy sender).
2. For every live prefill instance, predicted TTFT. With its own prefix ``own_len``: queue + prefill(n, own).
   Under ``kvcache-centric``, if best_len / own_len > threshold (own_len 0 counts as infinite) it fetches the
   missing blocks instead: transfer(missing, sender backlog) + queue + prefill(n, best). The strategy picks
   the instance (least TTFT; least queue for ``load-balance``; uniform for ``random``).
3. Decode instance: least predicted TBT, counting every request already routed there that will still be
   decoding when this one arrives (so a burst spreads), among those that can take the request. Under ``early``
   and ``predictive`` "can take" means the request's KV fits and the TBT stays within the SLO under the
   admission policy's own view of decode load (current, or predicted at the prefill's end); under ``none``
   and ``baseline`` only that its KV fits beside the routed load, if any instance's does.
4. Admission (``admission.py``): reject on predicted TTFT over the prefill's budget (the SLO less what follows the
   prefill: the KV push to the chosen decode instance where the first token waits for it,
   ``accounting.prefill_budget_s``), and under ``early`` / ``predictive``
   when no decode instance can take the request (KV capacity, then TBT), with a retry-after hint.
"""

from __future__ import annotations

import functools
import random
import zlib
from typing import NamedTuple

import numpy as np

from mooncake_jax.conductor import admission as adm
from mooncake_jax.conductor import kernels
from mooncake_jax.conductor.accounting import REAL_INSTANCES, ReleaseTiming, after_prefill_s, prefill_budget_s
from mooncake_jax.conductor.api import (Admission, Decision, PolicyConfig, RejectReason, Request, Snapshot, Strategy,
                                        Transfer, check_block_count)
from mooncake_jax.conductor.costs import transfer_seconds
from mooncake_jax.conductor.index import slot_groups, slots_of_mask
from mooncake_jax.conductor.instances import Role


class _PrefillChoice(NamedTuple):
    slot: int
    queue_s: float
    compute_s: float
    ttft_s: float
    transfer: Transfer | None
    prefix_blocks: int


class Policy:
    """Scheduling strategy + admission policy over snapshots; holds only its (immutable) configuration and, where
    numba is installed, the compiled kernels of its two vector phases (``kernels.py``)."""

    def __init__(self, config: PolicyConfig | None = None, compiled: bool = True,
                 timing: ReleaseTiming = REAL_INSTANCES, off_engine_s: float = 0.0):
        """``compiled``: make the decode choice and the prefill slot's argmin with the numba kernels
        (``kernels.py``) when numba is installed (compiled, or read from numba's cache, here). The numpy path decides
        the same (the prefill argmin up to two slots within an ulp of each other) at ~1.6x the CPU a decision.
        ``timing`` and ``off_engine_s``: when the instances release the first token and the measured time it
        takes off the engine (``accounting.after_prefill_s``): what the TTFT budget leaves after the prefill. The
        served cluster's instances push after the prefill and answer after the push; the simulator passes its
        own."""
        self.config = config or PolicyConfig()
        self.timing = timing
        self.off_engine_s = float(off_engine_s)
        after_prefill_s(timing, 0.0, 0.0, self.off_engine_s)  # (validates them)
        self._decode_kernel = kernels.decode_choice() if compiled else None
        self._prefill_kernel = kernels.prefill_slot() if compiled else None

    def decide(self, request: Request, snapshot: Snapshot, now: float) -> Decision:
        cfg = self.config
        check_block_count(request.block_keys, request.input_tokens, cfg.block_size, request.request_id)
        table = snapshot.instances
        if not table.count(Role.PREFILL):
            return Decision(request.request_id, RejectReason.NO_PREFILL_INSTANCE, cfg.min_retry_after_s)
        if not table.count(Role.DECODE):
            return Decision(request.request_id, RejectReason.NO_DECODE_INSTANCE, cfg.min_retry_after_s)
        prefill_ok, decode_ok = table.candidates(Role.PREFILL), table.candidates(Role.DECODE)

        prefill = self._choose_prefill(request, snapshot, now, prefill_ok)
        end = now + prefill.ttft_s
        slot_d, tbt = self._choose_decode(request, snapshot, now, end, decode_ok)
        if slot_d is None:
            reason, retry = RejectReason.DECODE_CAPACITY, self._retry_after(snapshot, None, now)
        else:
            after = self._after_prefill(request, table, prefill, slot_d)
            reason = adm.rejection(cfg, prefill.ttft_s, tbt, after)
            if reason is None:
                retry = 0.0
            elif reason is RejectReason.TTFT_SLO:
                retry = max(cfg.min_retry_after_s, prefill.ttft_s - prefill_budget_s(cfg.ttft_slo_s, after))
            else:  # TBT_SLO
                retry = self._retry_after(snapshot, slot_d, now)
        return Decision.made(request.request_id, reason, retry, table.ids[prefill.slot],
                             None if slot_d is None else table.ids[slot_d], prefill.transfer, prefill.prefix_blocks,
                             prefill.queue_s, prefill.compute_s, prefill.ttft_s, tbt, end)

    def _after_prefill(self, request: Request, table, prefill: _PrefillChoice, slot_d: int) -> float:
        """What of this request's TTFT follows its prefill (``accounting.after_prefill_s``): its KV's push from
        the chosen prefill instance to the chosen decode instance over their link, where the first token waits
        for it. (Not worked out under ``none``: nothing is checked.)"""
        if self.config.admission is Admission.NONE:
            return 0.0
        if self.timing.first_token == "at-prefill-end":  # nothing to push first (~2 us a decision saved)
            return self.off_engine_s
        push = transfer_seconds(request.input_tokens * table.kv_bytes_per_token.item(prefill.slot),
                                table.link_bytes_per_s.item(prefill.slot, slot_d))
        return after_prefill_s(self.timing, push, prefill.compute_s, self.off_engine_s)

    # ------------------------------------------------------------------------------------------- prefill

    def _choose_prefill(self, request: Request, snapshot: Snapshot, now: float,
                        candidates: np.ndarray) -> _PrefillChoice:
        """The prefill instance and its predicted queue, compute, TTFT and transfer plan (step 1 and 2).

        The slots fall into a few *groups* by their own matched prefix: those matching nothing, then one per level
        of the prefix match (one to three on the conversation trace). Everything the prefix decides (fetch or
        recompute, the prefix then held, the blocks moved, when the sender can start) is the same within a group,
        so it is worked out once per group in Python, as one row of features; every slot's TTFT is then one small
        matrix product of those rows with per-slot terms (its slowdown-scaled cost coefficients, a column of ones,
        its link from the sender in seconds per KV token, its queue), read through the slot's group. At a few
        hundred slots a numpy call costs its fixed ~0.35-2 us, not its length, so the call count is the cost:
        about ten here, whatever the cluster size or the number of groups. The chosen slot's figures are then
        worked out alone, with the one transfer-time formula (``costs.transfer_seconds``). With numba the product
        and its argmin are one compiled call (``kernels.prefill_slot``).
        """
        cfg, table = self.config, snapshot.instances
        block, n = cfg.block_size, request.input_tokens
        keys = request.block_keys
        levels = snapshot.index.match_levels(keys)  # load-balance ignores it to choose, not to predict
        reusable = n - 1  # the last prompt token is always computed: it yields the first output token
        capacity = table.capacity
        # rows: the four cost features' coefficients (each instance's own, scaled by how much slower than its model
        # its recent prefills ran: from the model alone, a predicted TTFT of 0.08 s was 0.98 s on a host at load
        # 20), ones (the sender's backlog), seconds per KV token from the sender, and when each queue drains (now
        # at the earliest; +inf off the prefill role): every TTFT plus ``now``, which moves no argmin
        terms = table.prefill_terms
        kernel = self._prefill_kernel if cfg.strategy is not Strategy.RANDOM else None
        if kernel is None:
            drained = terms[6]  # (``out=`` given by keyword costs a numpy call's time more than by position to add)
            np.add(np.maximum(table.queue_free_at, now), table.barrier(Role.PREFILL), drained)
        owns = [0]
        owns += [length for length, _ in levels]
        best_len = 0
        fetching = cfg.strategy is Strategy.KVCACHE_CENTRIC and len(owns) > 1
        if fetching:
            best_len, holders = levels[-1]
            source = self._best_source(holders, table)
            link_row = table.kv_seconds_per_token[source]  # (unread when no group fetches: their feature is 0)
            if kernel is None:
                terms[5] = link_row
            starts = self._send_starts(snapshot, source, keys, best_len, owns, now)
            threshold = cfg.kvcache_balancing_threshold
        rows, fetches = [], []
        for group, own in enumerate(owns):
            # fetch when own < best and best / own > threshold (own 0: infinite ratio); for own >= 0 one
            # comparison says both: with threshold >= 1 the second implies the first, below 1 the first the second
            fetch = fetching and (threshold * own < best_len if threshold >= 1 else own < best_len)
            prefix = min((best_len if fetch else own) * block, reusable)
            x = n - prefix
            if fetch:
                rows.append((1.0, x, x * x, x * prefix, max(starts[group] - now, 0.0), (best_len - own) * block, 1.0))
            else:
                rows.append((1.0, x, x * x, x * prefix, 0.0, 0.0, 1.0))
            fetches.append(fetch)
        if kernel is not None:  # the same argmin compiled (kernels.py), one call
            slot = kernel(np.array(rows), terms, link_row if fetching else _zeros(capacity), table.queue_free_at,
                          table.barrier(Role.PREFILL), float(now), slot_groups(tuple(m for _, m in levels), capacity),
                          cfg.strategy is Strategy.LOAD_BALANCE)
        elif cfg.strategy is Strategy.RANDOM:
            rng = random.Random(zlib.crc32(request.request_id.encode()) ^ cfg.seed)
            slot = int(rng.choice(np.flatnonzero(candidates)))
        else:
            ttft = np.dot(np.array(rows), terms)  # (converting first: np.dot converting a list costs ~1 us more)
            ttft = ttft[0] if len(rows) == 1 else ttft.take(slot_groups(tuple(m for _, m in levels), capacity))
            slot = int((drained if cfg.strategy is Strategy.LOAD_BALANCE else ttft).argmin())
        # the chosen slot's figures, alone
        group, bit = 0, 1 << slot
        for level, (_, mask) in enumerate(levels, 1):
            if mask & bit:
                group = level
                break
        own, fetch = owns[group], fetches[group]
        prefix = min((best_len if fetch else own) * block, reusable)
        x = n - prefix
        c0, c1, c2, c3 = table.prefill_terms[:4, slot].tolist()
        compute = c0 + c1 * x + c2 * x * x + c3 * x * prefix
        queue_s = max(table.queue_free_at.item(slot) - now, 0.0)
        total = queue_s + compute
        transfer = None
        if fetch:
            moved = (best_len - own) * (block * table.kv_bytes_per_token.item(slot))
            seconds = transfer_seconds(moved, table.link(source, slot), starts[group] - now)
            transfer = Transfer(table.ids[source], keys[own:best_len], moved, seconds)
            total += seconds
        return _PrefillChoice(slot, queue_s, compute, total, transfer, best_len if fetch else own)

    @staticmethod
    def _best_source(holders: int, table) -> int:
        """The slot holding the longest prefix (``holders``: their bit mask); among equals, the one whose sends
        drain first."""
        if not holders & (holders - 1):  # one holder
            return holders.bit_length() - 1
        slots = slots_of_mask(holders)
        return int(slots[table.send_free_at[slots].argmin()])  # the first of equals, as argmin

    @staticmethod
    def _send_starts(snapshot: Snapshot, source: int, keys: tuple[int, ...], best_len: int, owns: list[int],
                     now: float) -> list[float]:
        """When ``source`` can start sending each group (own prefix ``owns[g]`` blocks) its missing blocks
        ``keys[own:best_len]``: after its queued sends, and after those blocks land on it if they are only expected
        there (computed or fetched by a request still in flight)."""
        send_free_at = snapshot.instances.send_free_at.item(source)
        # whatever is expected there lands before it could send (or before now): the sends start as queued (how
        # long any wait is, ``start - now``, counts from now only); on the trace four decisions in five
        if snapshot.index.pending_until(source) <= max(send_free_at, now):
            return [send_free_at] * len(owns)
        ready = snapshot.index.ready_times(source, keys, best_len)  # (the request's own tuple: no slice made)
        if max(ready) <= send_free_at:  # all landed (or will have) before the source can send anyway
            return [send_free_at] * len(owns)
        last = best_len - 1
        return [max(send_free_at, max(ready[min(own, last):])) for own in owns]

    # -------------------------------------------------------------------------------------------- decode

    def _choose_decode(self, request: Request, snapshot: Snapshot, now: float, end: float,
                       candidates: np.ndarray) -> tuple[int | None, float]:
        """The decode instance (step 3) and the TBT the admission policy checks; slot None when none can hold
        the request's KV under the admission view (``early`` / ``predictive`` only).

        Written for the hot path (each numpy call costs its fixed overhead, so there are few): both ledger views
        from one pass (``DecodeLedger.decision_loads``), each view's step times as the sum of its requests' step
        shares (one weighted bincount in the ledger) plus this request's own, and the choice by masking the
        excluded instances with +inf (an argmin that lands on +inf means none qualified) instead of counting."""
        cfg, table = self.config, snapshot.instances
        kv = float(request.kv_tokens)  # (a Python int operand costs a numpy call more than a float)
        checks_here = cfg.admission in adm.CHECKS_DECODE_HERE  # (else the routed KV is what must fit)
        if self._decode_kernel is not None:  # the same arithmetic compiled (kernels.py), one call
            decode_s = snapshot.decode_time_per_slot
            if not isinstance(decode_s, np.ndarray):
                decode_s = _uniform(decode_s, table.capacity)
            start, started, slots, tokens, step = snapshot.ledger.columns()[:5]
            slot, tbt = self._decode_kernel(
                start, started, slots, tokens, step, decode_s, float(now), float(end),
                cfg.admission is Admission.EARLY, table.batch_limited, checks_here, kv, table.decode_coef[2],
                table.decode_fixed_s, table.decode_kv_room, table.max_batch, table.kv_capacity_tokens, candidates,
                table.barrier(Role.DECODE), float(cfg.tbt_slo_s))
            return (None, 0.0) if slot < 0 else (slot, tbt)
        shares, context, seen_shares, seen_context, seen_batch = snapshot.ledger.decision_loads(
            now, end, snapshot.decode_time_per_slot, table.capacity, cfg.admission is Admission.EARLY,
            table.batch_limited, not checks_here)
        # a slot's step time with this request: c0 + c1 + c2 * kv (its own step share and the fixed terms) plus
        # the step shares (c1 + c2 * tokens) of the requests counted there
        own = table.decode_coef[2] * kv
        own += table.decode_fixed_s
        load = shares + own  # what spreads a burst: all routed load
        seen_tbt = seen_shares + own
        if checks_here:
            # room for its KV, and a batch slot: a decode instance with every slot taken refuses it after its
            # prefill (late, the prefill wasted); refused here it costs nothing and the client is told at once
            seen_context += kv  # with this request
            refused = seen_context > table.decode_kv_room  # (and every slot that is not a decode instance)
            if seen_batch is not None:  # some decode instance registered its batch slots
                refused |= seen_batch >= table.max_batch
            over = seen_tbt > cfg.tbt_slo_s
            over |= refused
            np.putmask(load, over, np.inf)
            slot = int(load.argmin())
            if load.item(slot) == np.inf:  # none within the TBT SLO: report the best the view allows
                np.putmask(seen_tbt, refused, np.inf)
                slot = int(seen_tbt.argmin())
                if seen_tbt.item(slot) == np.inf:  # none can hold it
                    return None, 0.0
            return slot, seen_tbt.item(slot)
        context += kv
        fits = context <= table.kv_capacity_tokens  # context + kv: this request's KV beside the routed load
        fits &= candidates
        if np.count_nonzero(fits):
            slot = _argmin_among(load, fits)
        else:  # the decode instance itself queues or rejects it
            slot = int((load + table.barrier(Role.DECODE)).argmin())
        return slot, seen_tbt.item(slot)

    def _retry_after(self, snapshot: Snapshot, slot: int | None, now: float) -> float:
        """Until the next predicted decode completion (on ``slot``, or anywhere), at least the configured floor."""
        finish = snapshot.ledger.next_finish(slot, now, snapshot.decode_time_per_slot)
        wait = 0.0 if finish is None else finish - now
        return max(self.config.min_retry_after_s, wait)


@functools.lru_cache(maxsize=8)
def _zeros(capacity: int) -> np.ndarray:
    """Zeros for every slot, shared (never written): the link row of a decision where no group fetches (left
    writable, like the table's link rows, so that numba compiles one version of the kernel, not two)."""
    return np.zeros(capacity)


@functools.lru_cache(maxsize=8)
def _uniform(decode_s: float, capacity: int) -> np.ndarray:
    """One t_d for every slot, as the array the compiled decode choice takes; shared (never written), left writable
    like the table's per-slot t_d so that numba compiles one version of the kernel."""
    return np.full(capacity, float(decode_s))


def _argmin_among(values: np.ndarray, mask: np.ndarray) -> int:
    """Index of the least of ``values`` where ``mask`` holds (some entry does); overwrites ``values`` elsewhere.
    (On the hot path: ``np.where(mask, values, inf).argmin()`` and ``mask.any()`` cost several times an
    arithmetic operation on a few hundred entries, so neither is used here.)"""
    values[~mask] = np.inf
    return int(values.argmin())
