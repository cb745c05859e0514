"""Closed-form continuous batching against a step-by-step simulation, and the TBT definition."""

import math
import random

import numpy as np
import pytest

from mooncake_jax.conductor import DecodeCost
from mooncake_jax.sim.batch import ContinuousBatch
from mooncake_jax.slo import tbt_of_gaps as tbt_of


class Req:
    def __init__(self, arrival, input_tokens, steps):
        self.arrival, self.input_tokens, self.steps = arrival, input_tokens, steps
        self.finished_at = math.nan


def step_by_step(cost, requests):
    """One iteration at a time: a request joins at the first boundary at or after its arrival (or at once on an
    idle instance); returns each request's token times (first = arrival, as its first token came from prefill)."""
    c0, c1, c2 = cost
    pending = sorted(requests, key=lambda r: r.arrival)
    running, times, t = [], {}, 0.0
    while pending or running:
        while pending and (pending[0].arrival <= t or not running):
            r = pending.pop(0)
            t = max(t, r.arrival) if not running else t
            running.append([r, r.input_tokens, r.steps])
            times[id(r)] = [r.arrival]
        step = c0 + c1 * len(running) + c2 * sum(ctx for _, ctx, _ in running)
        t += step
        for entry in running:
            entry[1] += 1
            entry[2] -= 1
            times[id(entry[0])].append(t)
        running = [e for e in running if e[2] > 0]
    return times


def closed_form(cost, requests):
    b = ContinuousBatch(DecodeCost(cost), capacity_tokens=10**9)
    done = []
    for r in sorted(requests, key=lambda r: r.arrival):
        while b.batch and b.steps_to_finish() and b.time + b.duration(b.steps_to_finish()) < r.arrival:
            done += b.advance(b.steps_to_finish())
        if b.batch:
            done += b.advance(b.steps_until(r.arrival))
        else:
            b.idle_until(r.arrival)
        b.join(r, r.input_tokens, r.input_tokens + r.steps, r.steps, r.arrival)
    while b.batch:
        done += b.advance(b.steps_to_finish())
    return b, done


@pytest.mark.parametrize("seed", range(6))
def test_closed_form_matches_step_by_step(seed):
    rng = random.Random(seed)
    cost = (0.01, 0.002, 1e-6)
    requests = [Req(rng.uniform(0, 3), rng.randint(100, 5000), rng.randint(1, 60)) for _ in range(25)]
    times = step_by_step(cost, requests)
    b, done = closed_form(cost, requests)
    assert sorted(id(r) for r in done) == sorted(id(r) for r in requests)
    for r in requests:
        expected = np.diff(times[id(r)])
        gaps = b.gaps(r)
        assert len(gaps) == r.steps
        np.testing.assert_allclose(gaps, expected, rtol=1e-9, atol=1e-12)
        assert r.finished_at == pytest.approx(times[id(r)][-1], rel=1e-12)


def test_stalls_are_charged_to_running_requests_only():
    b = ContinuousBatch(DecodeCost((0.01, 0.0, 0.0)), capacity_tokens=100)
    a, c = Req(0.0, 10, 3), Req(0.0, 10, 2)
    b.join(a, 10, 13, 3, first_token_at=0.0)
    b.stall(2.0)  # e.g. a coupled node prefilling c
    b.join(c, 10, 12, 2, first_token_at=2.0)
    done = b.advance(b.steps_to_finish())
    assert done == [c] and b.gaps(c).tolist() == pytest.approx([0.01, 0.01])
    done = b.advance(b.steps_to_finish())
    assert done == [a] and b.gaps(a).tolist() == pytest.approx([2.01, 0.01, 0.01])
    with pytest.raises(RuntimeError):
        b.join(Req(0, 90, 20), 90, 110, 20, b.time)  # 110 > capacity 100


def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps():
    assert tbt_of([0.1] * 9 + [1.0]) == pytest.approx(1.0)
    assert tbt_of(list(range(1, 21))) == pytest.approx(19.5)  # the two longest of 20
    assert tbt_of([0.3]) == pytest.approx(0.3)
    assert math.isnan(tbt_of([]))
