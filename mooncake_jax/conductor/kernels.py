"""The decode choice and the prefill slot's argmin compiled with numba, when it is installed: one call each
instead of ~25 and ~7 numpy calls.

Why: a decision is a fixed count of numpy calls on short arrays, each costing its fixed ~0.35-2 us, plus the Python
around them. Measured in sequence (64 + 64 instances, 10^6 blocks, the trace replay of benchmarks/conductor.py),
answering the decode choice from a table instead of computing it took a decision from ~75 to ~50 us (load 6.4), and
the prefill choice too to ~21 us: the two cost two thirds of a decision there. The decode kernel does its arithmetic
in one pass over the ledger's entries and one over the slots; the prefill one evaluates every slot's TTFT from its
prefix group's row of features and keeps the least (the groups themselves stay in Python, ``Policy._choose_prefill``).

The decode kernel's result is the numpy path's exactly (``Policy._choose_decode`` over
``DecodeLedger.decision_loads``): the same sums in the same order (a weighted bincount adds entry by entry), the same
roundings (each product and sum rounded on its own: numba compiles without fastmath, so no fused multiply-add), the
first minimum on ties. The prefill kernel's argmin is the numpy path's up to rounding (``_prefill_slot``).
``tests/test_conductor_decision_oracle.py`` runs its cases on both paths.

Without numba (an optional dependency: ``pip install mooncake-jax[fast]``), ``decode_choice()`` and
``prefill_slot()`` are None and the policy takes the numpy path.
"""

from __future__ import annotations

import functools
import logging

import numpy as np


def _decode_choice(start, started, slots, tokens, step, decode_s, now, when, seen_now, count, checks_here, kv,
                   c2, fixed, kv_room, max_batch, kv_capacity, candidates, barrier, tbt_slo):
    """(slot, admission-view TBT): the decode instance ``Policy._choose_decode`` picks, slot -1 when none can hold
    the request (``checks_here`` only). ``decode_s``: t_d per slot (an array as long as the slot columns).

    Entry columns ``start`` .. ``step`` are the ledger's used entries (slot -1: a free one); the slot columns are the
    instance table's. Buckets as the ledger's bincount: 4 * slot + 2 * committed + seen, then summed per view the
    way ``decision_loads`` sums its buckets."""
    n = c2.shape[0]
    sums = np.zeros((3, 4 * n))  # step shares, kv tokens, requests
    for i in range(start.shape[0]):
        slot = slots[i]
        if slot < 0:
            continue
        begin = start[i] if started[i] else max(start[i], now)
        end = begin + decode_s[slot]
        committed = end > when or (started[i] and end <= now)
        if seen_now:
            seen = start[i] <= now
        elif not committed:  # (the routed view's part only: the rest is dropped)
            continue
        elif when >= now:
            seen = start[i] <= when
        else:
            seen = begin <= when
        bucket = 4 * slot + (2 if committed else 0) + (1 if seen else 0)
        sums[0, bucket] += step[i]
        sums[1, bucket] += tokens[i]
        sums[2, bucket] += 1.0
    load = np.empty(n)
    seen_tbt = np.empty(n)
    refused = np.zeros(n, np.bool_)
    fits = np.zeros(n, np.bool_)
    for s in range(n):
        b = 4 * s
        if seen_now:
            routed, routed_kv = sums[0, b + 2] + sums[0, b + 3], sums[1, b + 2] + sums[1, b + 3]
            seen_sh, seen_kv = sums[0, b + 1] + sums[0, b + 3], sums[1, b + 1] + sums[1, b + 3]
            seen_n = sums[2, b + 1] + sums[2, b + 3]
        else:
            seen_sh, seen_kv, seen_n = sums[0, b + 3], sums[1, b + 3], sums[2, b + 3]
            routed, routed_kv = sums[0, b + 2] + seen_sh, sums[1, b + 2] + seen_kv
        own = c2[s] * kv
        own = own + fixed[s]
        load[s] = routed + own
        seen_tbt[s] = seen_sh + own
        if checks_here:
            refused[s] = seen_kv + kv > kv_room[s] or (count and seen_n >= max_batch[s])
        else:
            fits[s] = routed_kv + kv <= kv_capacity[s] and candidates[s]
    if checks_here:
        masked = load.copy()
        for s in range(n):
            if seen_tbt[s] > tbt_slo or refused[s]:
                masked[s] = np.inf
        slot = masked.argmin()
        if masked[slot] == np.inf:  # none within the TBT SLO: the best the view allows
            for s in range(n):
                masked[s] = np.inf if refused[s] else seen_tbt[s]
            slot = masked.argmin()
            if masked[slot] == np.inf:
                return -1, 0.0
        return slot, seen_tbt[slot]
    if fits.any():
        masked = load.copy()
        for s in range(n):
            if not fits[s]:
                masked[s] = np.inf
        slot = masked.argmin()
    else:
        slot = (load + barrier).argmin()
    return slot, seen_tbt[slot]


def _prefill_slot(rows, terms, kv_row, queue_free_at, barrier, now, groups, load_balance):
    """The prefill slot ``Policy._choose_prefill`` picks under ``load-balance`` or a TTFT-choosing strategy: the
    first least of every slot's queue drain time (``load_balance``) or of its TTFT, the dot product of its group's
    row of features with its column of terms (rows 0-4 of ``terms``; row 5 the sender's link ``kv_row``; row 6 the
    drain time). ``groups``: ``index.slot_groups``' flat index (group * slots + slot).

    The numpy path computes the same products with a matrix product, whose sums may round in another order: the
    TTFTs agree to ~1e-15 relative, and only their argmin is read (the chosen slot's figures are worked out
    apart), so a decision could differ only between two slots within an ulp of each other."""
    n = queue_free_at.shape[0]
    best, best_value = 0, np.inf
    for s in range(n):
        drained = max(queue_free_at[s], now) + barrier[s]
        if load_balance:
            value = drained
        else:
            g = groups[s] // n
            value = (rows[g, 0] * terms[0, s] + rows[g, 1] * terms[1, s] + rows[g, 2] * terms[2, s]
                     + rows[g, 3] * terms[3, s] + rows[g, 4] * terms[4, s] + rows[g, 5] * kv_row[s]
                     + rows[g, 6] * drained)
        if s == 0 or value < best_value:
            best, best_value = s, value
    return best


@functools.cache
def prefill_slot():
    """The compiled ``_prefill_slot``, or None without numba; compiled (or read from numba's on-disk cache) here,
    with a call on arrays of the real ones' types, so that no request waits for it (a few seconds cold)."""
    numba = _numba()
    if numba is None:
        return None
    groups = np.arange(2)
    groups.flags.writeable = False  # (as index.slot_groups hands them out)
    return _compiled(numba, _prefill_slot, np.ones((1, 7)), np.ones((7, 2)), np.zeros(2), np.zeros(2), np.zeros(2),
                     0.0, groups, False)


@functools.cache
def decode_choice():
    """The compiled ``_decode_choice``, or None without numba; compiled (or read from numba's on-disk cache) here,
    with a call on arrays of the real ones' types, so that no request waits for it. Only a process that makes a
    ``Policy`` imports numba (~0.5 s)."""
    numba = _numba()
    if numba is None:
        return None
    one, ones = np.zeros(1), np.ones(2)
    return _compiled(numba, _decode_choice, one, np.zeros(1, np.bool_), np.zeros(1, np.int64), one, one, ones, 0.0,
                     1.0, False, False, True, 1.0, ones, ones, ones, ones, ones, np.ones(2, np.bool_), ones, 1.0)


def _compiled(numba, function, *example):
    """``function`` compiled by numba and called once on ``example`` arguments, or None (one log line) where numba
    is installed but cannot compile it (a numba / numpy mismatch, no writable cache directory): the numpy path
    decides the same, so a broken optional accelerator never stops a Conductor or a simulation."""
    try:
        kernel = numba.njit(cache=True)(function)
        kernel(*example)
    except Exception as err:  # noqa: BLE001 - any failure of the optional compiler falls back
        logging.getLogger(__name__).warning("numba could not compile %s (%s); using the numpy path",
                                            function.__name__, err)
        return None
    return kernel


def _numba():
    try:
        import numba
    except ImportError:  # a core dependency, but an install without it still decides the same (numpy path)
        return None
    return numba
