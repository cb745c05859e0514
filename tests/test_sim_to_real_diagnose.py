"""``benchmarks/sim_to_real_diagnose.py``'s two readings, worked by hand: compute over the profile's prediction per
band of new tokens, and the share of each long prompt's compute that ran beside another prefill."""

from types import SimpleNamespace

import pytest

import benchmark_script
from mooncake_jax.conductor.costs import PrefillCost


def _diagnose():
    return benchmark_script.load("sim_to_real_diagnose")


COSTS = SimpleNamespace(prefill=PrefillCost((0.0, 1e-3, 0.0, 0.0)))  # 1 ms per new token, no chunk padding


def test_compute_over_profile_by_band_counts_new_tokens():
    d = _diagnose()
    rows = [(100, 0, 0.3), (500, 100, 0.8), (2000, 0, 4.0), (1040, 16, 2.048)]  # (prompt, cached, compute s)
    # short: 100 + 400 new tokens -> 0.5 s predicted, 1.1 s ran; long: 2,000 + 1,024 -> 3.024 s, 6.048 s ran
    assert d.compute_over_profile(rows, COSTS, 0, 1024) == pytest.approx(1.1 / 0.5)
    assert d.compute_over_profile(rows, COSTS, 1024, 1 << 30) == pytest.approx(2.0)
    assert d.compute_over_profile(rows, COSTS, 5000, 6000) is None


def test_overlapped_is_the_share_of_each_long_prompt_beside_another_prefill():
    d = _diagnose()
    # a long prompt 0-1 s beside a short one 0.5-2 s (half of it), a long one 3-4 s alone: (0.5 + 0) / 2
    assert d.overlapped([(2000, 0.0, 1.0), (100, 0.5, 2.0), (1500, 3.0, 4.0)]) == pytest.approx(0.25)
    assert d.overlapped([(100, 0.0, 1.0)]) is None  # no long prompt
