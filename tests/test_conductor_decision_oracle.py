"""The policy's vectorised decision path against a straightforward per-instance recomputation of Algorithm 1.

``Policy.decide`` evaluates every instance in a few array operations (groups of slots by prefix level, one matrix
product, both decode ledger views from one pass). The oracle below recomputes each decision the plain way: for
every prefill instance its own prefix by walking the prompt's keys, fetch-or-recompute, the cost model through
``costs.prefill_seconds``, the transfer through ``costs.transfer_seconds``; for every decode instance its routed
and admission-view load by walking the ledger's entries one by one. Thousands of seeded trace requests (real
prefix sharing, compressed in time so queues build, SLOs and decode capacities tight enough that every rejection
reason occurs) are replayed through ``ClusterState`` with decode milestones, heartbeats and KV events; before each
decision is applied it must equal the oracle's: the same instances, transfer plan and rejection reason, and the
same predicted times (to 1e-9 relative: the two sum the same terms in different orders). Every case runs twice: with
the decode choice compiled (``conductor/kernels.py``, where numba is installed) and on the numpy path.
"""

import math
import random
import zlib

import numpy as np
import pytest

from mooncake_jax.conductor import (ClusterState, Policy, PolicyConfig, Request, index_kernels, instance_costs,
                                   kernels)
from mooncake_jax.conductor.api import Admission, RejectReason, Strategy
from mooncake_jax.conductor.costs import decode_step_seconds, prefill_seconds, transfer_seconds
from mooncake_jax.conductor.flat_index import FlatBlockIndex
from mooncake_jax.conductor.instances import Role
from mooncake_jax.sim.trace import load_trace

BLOCK = 512
KINDS = ("8xA800", "8xH800", "8xH200")


def own_prefix(index, slot, keys):
    """Leading keys of ``keys`` that ``slot`` holds, walking them one by one."""
    n = 0
    for key in keys:
        if index.tier(key, slot) is None:
            break
        n += 1
    return n


def entry_window(entry, now, decode_s):
    """(begin, end) of a ledger entry's predicted decode (the ledger module's rules, written out)."""
    _, start, _, started = entry
    begin = start if started else max(start, now)
    end = begin + decode_s
    if started and end <= now:
        end = math.inf
    return begin, end


def oracle(cfg: PolicyConfig, state: ClusterState, request: Request, now: float) -> dict:
    table, index, ledger = state.instances, state.index, state.ledger
    slots = [s for s in range(table.capacity) if table.ids[s] is not None]
    prefills = [s for s in slots if table.role[s] == Role.PREFILL]
    decodes = [s for s in slots if table.role[s] == Role.DECODE]
    if not prefills:
        return dict(reason=RejectReason.NO_PREFILL_INSTANCE)
    if not decodes:
        return dict(reason=RejectReason.NO_DECODE_INSTANCE)
    keys, n, kv = request.block_keys, request.input_tokens, request.kv_tokens
    own = {s: own_prefix(index, s, keys) for s in slots}
    best_len = max(own.values())
    kvcentric = cfg.strategy == Strategy.KVCACHE_CENTRIC and best_len > 0
    if kvcentric:
        holders = [s for s in slots if own[s] == best_len]
        source = min(holders, key=lambda s: (table.send_free_at[s], s))
        ready = index.ready_times(source, keys[:best_len])
    threshold = cfg.kvcache_balancing_threshold

    # step 2: every prefill instance's predicted TTFT
    choice = {}
    for s in prefills:
        queue = max(table.queue_free_at[s] - now, 0.0)
        fetch = kvcentric and (own[s] == 0 or (own[s] < best_len and best_len / own[s] > threshold))
        prefix = min((best_len if fetch else own[s]) * BLOCK, n - 1)
        compute = table.prefill_slowdown[s] * prefill_seconds(table.prefill_coef[:, s], n, prefix)
        transfer = None
        ttft = queue + compute
        if fetch:
            start = max([table.send_free_at[source]] + ready[min(own[s], best_len - 1):])
            moved = (best_len - own[s]) * BLOCK * table.kv_bytes_per_token[s]
            seconds = transfer_seconds(moved, table.link(source, s), start - now)
            transfer = (table.ids[source], keys[own[s]:best_len], moved, seconds)
            ttft += seconds
        choice[s] = dict(queue_s=queue, prefill_s=compute, predicted_ttft_s=ttft, transfer=transfer,
                         prefix_blocks=best_len if fetch else own[s])
    if cfg.strategy == Strategy.RANDOM:
        rng = random.Random(zlib.crc32(request.request_id.encode()) ^ cfg.seed)
        p = rng.choice(prefills)
    elif cfg.strategy == Strategy.LOAD_BALANCE:
        p = min(prefills, key=lambda s: (choice[s]["queue_s"], s))
    else:
        p = min(prefills, key=lambda s: (choice[s]["predicted_ttft_s"], s))
    out = dict(choice[p], prefill=table.ids[p])
    end = now + out["predicted_ttft_s"]
    out["prefill_end_at"] = end

    # step 3: every decode instance's routed load and the load admission judges, entry by entry
    per_slot_td = state.snapshot().decode_time_per_slot
    ends_after_now = {}
    routed = {d: [0, 0.0] for d in decodes}
    seen = {d: [0, 0.0] for d in decodes}
    for request_id in [r for d in decodes for r in ledger.ids_on(d)]:  # every request in flight
        entry = ledger.get(request_id)
        slot, start, tokens, _ = entry
        td = per_slot_td[slot] if isinstance(per_slot_td, np.ndarray) else per_slot_td
        begin, finish = entry_window(entry, now, td)
        if finish > now and math.isfinite(finish):
            ends_after_now.setdefault(slot, []).append(finish)
        if slot not in routed:
            continue
        committed = finish > end
        in_view = start <= now if cfg.admission == Admission.EARLY else committed and begin <= end
        for view, counted in ((routed, committed), (seen, in_view)):
            if counted:
                view[slot][0] += 1
                view[slot][1] += tokens

    def step(d, batch, context):
        return float(decode_step_seconds(table.decode_coef[:, d], batch, context))

    def retry_after(slot):
        finishes = [t for s, ts in ends_after_now.items() if slot is None or s == slot for t in ts]
        return max(cfg.min_retry_after_s, (min(finishes) - now) if finishes else 0.0)

    load = {d: step(d, routed[d][0] + 1, routed[d][1] + kv) for d in decodes}
    if cfg.admission in (Admission.EARLY, Admission.PREDICTIVE):
        fits = [d for d in decodes if seen[d][1] + kv <= table.kv_capacity_tokens[d]
                and seen[d][0] < table.max_batch[d]]
        if not fits:
            return dict(out, decode=None, predicted_tbt_s=0.0, reason=RejectReason.DECODE_CAPACITY,
                        retry_after_s=retry_after(None))
        tbt = {d: step(d, seen[d][0] + 1, seen[d][1] + kv) for d in fits}
        ok = [d for d in fits if tbt[d] <= cfg.tbt_slo_s]
        d = min(ok, key=lambda s: (load[s], s)) if ok else min(fits, key=lambda s: (tbt[s], s))
        predicted_tbt = tbt[d]
    else:
        fits = [d for d in decodes if routed[d][1] + kv <= table.kv_capacity_tokens[d]]
        d = min(fits or decodes, key=lambda s: (load[s], s))
        predicted_tbt = step(d, seen[d][0] + 1, seen[d][1] + kv)
    out.update(decode=table.ids[d], predicted_tbt_s=predicted_tbt)

    # step 4: admission, the TTFT against the prefill's budget: the SLO less the push of the request's KV from the
    # chosen prefill instance to the chosen decode instance (the served cluster's first token waits for it)
    reason, retry = None, 0.0
    if cfg.admission != Admission.NONE:
        p = table.slot(out["prefill"])
        budget = cfg.ttft_slo_s - transfer_seconds(float(n * table.kv_bytes_per_token[p]),
                                                   float(table.link_bytes_per_s[p, d]))
        if out["predicted_ttft_s"] > budget:
            reason = RejectReason.TTFT_SLO
            retry = max(cfg.min_retry_after_s, out["predicted_ttft_s"] - budget)
        elif cfg.admission in (Admission.EARLY, Admission.PREDICTIVE) and predicted_tbt > cfg.tbt_slo_s:
            reason, retry = RejectReason.TBT_SLO, retry_after(d)
    return dict(out, reason=reason, retry_after_s=retry)


def check(decision, expected: dict) -> None:
    got = dict(reason=decision.reason, prefill=decision.prefill, decode=decision.decode,
               prefix_blocks=decision.prefix_blocks,
               transfer=None if decision.transfer is None else (decision.transfer.source, decision.transfer.keys))
    want = {k: expected.get(k) for k in got}
    if expected.get("transfer") is not None:
        want["transfer"] = expected["transfer"][:2]
    assert got == want, decision.request_id
    for name in ("queue_s", "prefill_s", "predicted_ttft_s", "prefill_end_at", "predicted_tbt_s", "retry_after_s"):
        assert getattr(decision, name) == pytest.approx(expected[name], rel=1e-9, abs=1e-12), \
            (decision.request_id, name)
    if decision.transfer is not None:
        assert decision.transfer.n_bytes == pytest.approx(expected["transfer"][2], rel=1e-12)
        assert decision.transfer.seconds == pytest.approx(expected["transfer"][3], rel=1e-9)


@pytest.fixture(params=["compiled", "numpy"])
def compiled(request) -> bool:
    """The decode choice and the block index compiled (numba) or on the numpy / dict path."""
    if request.param == "compiled" and (kernels.decode_choice() is None or index_kernels.compiled() is None):
        pytest.skip("numba is not installed: no compiled decode choice to check")
    return request.param == "compiled"


def replay(cfg: PolicyConfig, n_requests: int, speed: float, capacity: int, seed: int,
           batch_slots: bool = True, compiled: bool = False) -> dict:
    """Replay the conversation trace's first ``n_requests`` (arrivals ``speed`` times faster) through a state of 6
    prefill and 5 decode instances of three hardware kinds, checking every decision against the oracle; returns how
    often each outcome occurred. Between decisions: decode starts and finishes reported a little off their
    predictions, a prefill instance's KV event confirming a request's blocks when its decode starts, evictions, and
    load reports (queue, prefill slowdown). ``batch_slots``: some decode instances register a batch limit (without
    any, the policy counts no requests per instance: that path is checked too)."""
    rng = np.random.default_rng(seed)
    state, policy = ClusterState(cfg, compiled=compiled), Policy(cfg, compiled=compiled)
    assert (policy._decode_kernel is not None) == compiled
    assert isinstance(state.index, FlatBlockIndex) == compiled
    costs = {kind: instance_costs(kind, "llama2-70b") for kind in KINDS}
    for i in range(6):
        state.add_instance(f"p{i}", "prefill", costs[KINDS[i % 3]], 0.0)
    for i in range(5):  # decode capacities (KV tokens) and batch slots tight enough that both refuse requests
        state.add_instance(f"d{i}", "decode", costs[KINDS[(i + 1) % 3]], 0.0, kv_capacity_tokens=capacity * (i + 1),
                           max_batch=None if i % 2 or not batch_slots else 12 + 4 * i)
    state.set_link("p0", "p3", 1e9)  # a pair with its own link, slower than either NIC
    trace = load_trace("conversation", first=n_requests)
    outcomes: dict = {}
    milestones: list = []  # (time, order, report)
    for i, row in enumerate(trace):
        now = row.timestamp_s / speed
        milestones.sort(key=lambda m: m[:2])
        while milestones and milestones[0][0] <= now:
            milestones.pop(0)[2]()
        if i % 25 == 0:  # a prefill instance's load report, and an eviction on another
            state.heartbeat(f"p{rng.integers(6)}", now, queued_s=float(rng.uniform(0, 2)),
                            prefill_slowdown=float(rng.uniform(0.8, 1.6)))
            state.kv_removed(f"p{rng.integers(6)}", trace[int(rng.integers(i + 1))].hash_ids)
        request = Request(f"r{i}", row.hash_ids, row.input_length, row.output_length)
        expected = oracle(cfg, state, request, now)
        decision = state.schedule(policy, request, now)
        check(decision, expected)
        key = decision.reason.value if decision.reason else ("fetch" if decision.transfer else "accepted")
        outcomes[key] = outcomes.get(key, 0) + 1
        if decision.accepted:
            start = decision.prefill_end_at + float(rng.uniform(-0.2, 0.5))  # reported a little off the prediction
            rid, prefill, keys = request.request_id, decision.prefill, request.block_keys
            milestones.append((start, i, lambda rid=rid, start=start: state.decode_started(rid, start)))
            milestones.append((start, i, lambda p=prefill, keys=keys: state.kv_stored(p, keys)))
            end = start + float(rng.uniform(2, 40))
            milestones.append((end, i, lambda rid=rid, end=end: state.finished(rid, end)))
    return outcomes


CASES = [  # strategy, admission, balancing threshold, speed-up, TBT SLO, decode KV capacity unit, outcomes it must see
    ("kvcache-centric", "predictive", 1.0, 1.5, 0.011, 60_000, {"accepted", "fetch", "ttft_slo", "tbt_slo"}),
    ("kvcache-centric", "early", 2.0, 2.0, 0.011, 12_000, {"accepted", "fetch", "decode_capacity", "tbt_slo"}),
    ("kvcache-centric", "baseline", 0.5, 6.0, 0.011, 60_000, {"accepted", "fetch", "ttft_slo"}),
    ("local-cache-aware", "predictive", 1.0, 2.0, 0.011, 20_000, {"accepted", "decode_capacity"}),
    ("load-balance", "none", 1.0, 3.0, 0.011, 60_000, {"accepted"}),
    ("random", "early", 1.0, 2.0, 0.011, 20_000, {"accepted", "decode_capacity"}),
]


@pytest.mark.parametrize("strategy, admission, threshold, speed, tbt_slo, capacity, must_see", CASES)
def test_decisions_equal_a_per_instance_recomputation(strategy, admission, threshold, speed, tbt_slo, capacity,
                                                      must_see, compiled):
    cfg = PolicyConfig(strategy=strategy, admission=admission, block_size=BLOCK, kvcache_balancing_threshold=threshold,
                       ttft_slo_s=8.0, tbt_slo_s=tbt_slo)
    outcomes = replay(cfg, 600, speed, capacity, seed=len(strategy) + len(admission), compiled=compiled)
    assert sum(outcomes.values()) == 600
    # the check means something only where the replay reached these branches
    assert must_see <= set(outcomes), outcomes


@pytest.mark.parametrize("admission, must_see", [("predictive", {"accepted", "decode_capacity", "tbt_slo"}),
                                                 ("early", {"accepted", "decode_capacity", "tbt_slo"})])
def test_decisions_equal_the_recomputation_without_batch_limits(admission, must_see, compiled):
    """No decode instance registers its batch slots: the policy skips counting requests per instance
    (``InstanceTable.batch_limited``), and its decisions must still be the oracle's."""
    cfg = PolicyConfig(strategy="kvcache-centric", admission=admission, block_size=BLOCK, ttft_slo_s=8.0,
                       tbt_slo_s=0.011)
    outcomes = replay(cfg, 600, 2.0, 12_000, seed=7, batch_slots=False, compiled=compiled)
    assert sum(outcomes.values()) == 600
    assert must_see <= set(outcomes), outcomes
