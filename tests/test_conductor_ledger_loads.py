"""DecodeLedger.decision_loads against a per-entry recomputation of the ledger's rules (module docstring), while
the ledger grows past its capacity, reuses freed entries and has requests start, finish and move between calls (its
column views are kept between calls: a stale one would sum old arrays)."""

import math
import random
import types

import numpy as np
import pytest

from mooncake_jax.conductor.ledger import DecodeLedger

N_SLOTS = 6


def naive_loads(entries, now, when, decode_s, seen_now, coef):
    """(routed shares, routed kv, seen shares, seen kv, seen count) per slot, entry by entry."""
    out = [np.zeros(N_SLOTS) for _ in range(5)]
    for slot, start, tokens, started in entries.values():
        t_d = decode_s[slot] if isinstance(decode_s, np.ndarray) else decode_s
        begin = start if started else max(start, now)
        end = begin + t_d
        if started and end <= now:  # decoding past t_d: stays until reported finished
            end = math.inf
        committed = end > when
        seen = start <= now if seen_now else (committed and begin <= when)
        share = coef[1, slot] + coef[2, slot] * tokens
        if committed:
            out[0][slot] += share
            out[1][slot] += tokens
        if seen:
            out[2][slot] += share
            out[3][slot] += tokens
            out[4][slot] += 1
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_decision_loads_equal_a_per_entry_recomputation(seed):
    rng = random.Random(seed)
    coef = np.array([[0.01] * N_SLOTS, [0.002 + 0.001 * s for s in range(N_SLOTS)],
                     [1e-6 * (s + 1) for s in range(N_SLOTS)]])
    ledger = DecodeLedger(capacity=4, instances=types.SimpleNamespace(decode_coef=coef))
    entries: dict[str, tuple[int, float, float, bool]] = {}
    now, checked = 0.0, 0
    for step in range(400):
        now += rng.uniform(0.0, 0.3)
        action = rng.random()
        if action < 0.45 or not entries:
            rid = f"r{step}"
            slot, start, tokens = rng.randrange(N_SLOTS), now + rng.uniform(-0.5, 2.0), float(rng.randrange(1, 4000))
            started = rng.random() < 0.3
            ledger.add(rid, slot, start, tokens, started=started)
            entries[rid] = (slot, start, tokens, started)
        elif action < 0.7:
            rid = rng.choice(sorted(entries))
            assert ledger.remove(rid)
            del entries[rid]
        else:
            rid = rng.choice(sorted(entries))
            slot, start, tokens, started = entries[rid]
            new_start = now - rng.uniform(0.0, 3.0)
            ledger.set_start(rid, new_start, started=True)
            entries[rid] = (slot, new_start, tokens, True)
        when = now + rng.uniform(-0.1, 3.0)
        per_slot = np.array([rng.uniform(1.0, 6.0) for _ in range(N_SLOTS)])
        for decode_s in (2.5, per_slot):
            for seen_now in (False, True):
                got = ledger.decision_loads(now, when, decode_s, N_SLOTS, seen_now, count=True)
                want = naive_loads(entries, now, when, decode_s, seen_now, coef)
                names = ("routed shares", "routed kv", "seen shares", "seen kv", "seen count")
                for name, g, w in zip(names, got, want):
                    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=f"{name} at step {step}")
                checked += 1
    assert len(ledger._slot) > 4  # it grew past its capacity while being read
    assert checked == 1600
