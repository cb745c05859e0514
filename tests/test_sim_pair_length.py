"""A prefill's slowdown beside another prefill grows with its length (sim/host.py ``pair_length_factor``,
``SimConfig.host_pair_length_exponent``), fitted from the contention probe's pairs at several lengths
(benchmarks/sim_real/host_fit.py ``pair_length_exponent``). Rates and timings worked by hand."""

import math
import sys
from pathlib import Path

import pytest

from mooncake_jax.conductor import DecodeCost, InstanceCosts, PrefillCost
from mooncake_jax.sim import SimConfig, simulate
from mooncake_jax.sim.host import pair_length_factor, paired_rate, shared_rates
from mooncake_jax.sim.trace import Trace, TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sim_real.host_fit import host_model, host_rates, pair_length_exponent  # noqa: E402

# 1 ms per computed token, nothing fixed; decode irrelevant (one output token: no decode)
MS_PER_TOKEN = InstanceCosts("ms-per-token", PrefillCost((0.0, 0.001, 0.0, 0.0)), DecodeCost((0.01, 0.0, 0.0)),
                             kv_bytes_per_token=1.0, nic_bytes_per_s=1e12, kv_capacity_tokens=10**6)


def test_the_factor_and_the_paired_rate_by_hand():
    assert pair_length_factor(512, 0.5) == 1.0
    assert pair_length_factor(2048, 0.5) == pytest.approx(2.0)
    assert pair_length_factor(128, 0.5) == 1.0  # shorter ones keep the 512-token reference's slowdown
    assert pair_length_factor(4096, 0.0) == 1.0
    assert paired_rate(0.8, 2048, 0.5, 1) == 0.8  # alone: no partner, no factor
    assert paired_rate(0.8, 2048, 0.5, 2) == pytest.approx(0.4)
    # two prefills and one other process on two cores: 2/3 of a core each; a 1,024-token one 2/3 / sqrt(2), a
    # 256-token one 2/3 as at 512
    shared = shared_rates(2, 2, 0, others=1.0)[0]
    assert shared == pytest.approx(2 / 3)
    assert paired_rate(shared, 1024, 0.5, 2) == pytest.approx(2 / 3 / math.sqrt(2))
    assert paired_rate(shared, 256, 0.5, 2) == pytest.approx(2 / 3)
    assert paired_rate(0.9, 2048, -0.5, 2) == 1.0  # never faster than its cost model
    with pytest.raises(ValueError, match="host_pair_length_exponent must be a number from -2 to 2"):
        SimConfig(host_cores=2, host_pair_length_exponent=3.0)
    with pytest.raises(ValueError, match="needs host_cores"):
        SimConfig(host_pair_length_exponent=0.5)


def _two_prefills(exponent: float):
    """A 2,048-token and a 512-token prompt arriving together on two prefill instances sharing two cores."""
    trace = Trace([TraceRequest(0.0, 2048, 1, (1, 2, 3, 4)), TraceRequest(0.0, 512, 1, (5,))])
    return simulate(trace, prefill=2, decode=1, hardware=MS_PER_TOKEN, host_cores=2,
                    host_pair_length_exponent=exponent).requests


def test_a_long_prefill_beside_a_short_one_is_slowed_by_its_length():
    """Two prefills on two cores: each a core (shared rate 1). Exponent 0.5: the 2,048-token one runs at
    1 / (2048/512)**0.5 = 0.5 while the 512-token one (factor 1) computes, 0.512 s; it has done 0.256 s of its
    2.048 s then, and the rest alone at full speed: it ends at 0.512 + 1.792 = 2.304 s. Exponent 0: 2.048 s."""
    long, short = _two_prefills(0.5)
    assert short.ttft_s == pytest.approx(0.512)
    assert long.ttft_s == pytest.approx(2.304)
    long, short = _two_prefills(0.0)
    assert (long.ttft_s, short.ttft_s) == pytest.approx((2.048, 0.512))


def _readings(exponent: float, base: float = 1.13) -> dict:
    """Synthetic contention readings: alone n ms at n tokens, paired ``base * (n / 512) ** exponent`` times that."""
    read = {"contention_compute_s_alone": 0.512, "contention_compute_s_pair": 0.512 * base}
    for n in (256, 1024, 2048):
        read[f"contention_compute_s_alone_{n}"] = n / 1000
        read[f"contention_compute_s_pair_{n}"] = n / 1000 * base * (n / 512) ** exponent
    return read


def test_the_exponent_is_fitted_from_the_pairs_at_each_length():
    assert pair_length_exponent(_readings(0.3)) == pytest.approx(0.3)
    assert pair_length_exponent(_readings(0.0)) == pytest.approx(0.0, abs=1e-12)
    assert pair_length_exponent(_readings(-0.2, base=1.5)) == pytest.approx(-0.2)
    # the 256-token pairs are not read: 2.1x there (fixed costs) moves nothing
    assert pair_length_exponent({**_readings(0.3), "contention_compute_s_pair_256": 0.256 * 2.1}) == pytest.approx(0.3)
    assert pair_length_exponent(_readings(3.0)) == 1.0  # within -1 to 1
    # 1.3x at 1,024 and 1.7x at 2,048 over 1.13x at 512 (the twelfth pass's readings, by request): log-slope
    read = {"contention_compute_s_alone": 1.0, "contention_compute_s_pair": 1.13,
            "contention_compute_s_alone_1024": 1.0, "contention_compute_s_pair_1024": 1.3,
            "contention_compute_s_alone_2048": 1.0, "contention_compute_s_pair_2048": 1.7}
    x, y = [math.log(2), math.log(4)], [math.log(1.3 / 1.13), math.log(1.7 / 1.13)]
    assert pair_length_exponent(read) == pytest.approx(sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x))
    assert pair_length_exponent({"contention_compute_s_alone": 1.0, "contention_compute_s_pair": 1.1}) is None
    assert pair_length_exponent({"contention_compute_s_alone": 1.0, "contention_compute_s_pair": 1.1,
                                 "contention_compute_s_alone_256": 1.0, "contention_compute_s_pair_256": 2.0}) is None


def test_the_probe_host_carries_the_exponent_into_the_rates_it_divides_out():
    """``host_rates`` with a prefill's tokens gives the simulator's paired speed: what the bursts' engine reading
    divides out (``engine_in_bursts``) is what the simulator puts back."""
    host = host_model(2, {"host_pair_exponent": 0.5})
    assert host_rates(host, 2, 0)[0] == 1.0  # the 512-token reference: no factor
    assert host_rates(host, 2, 0, 2048)[0] == pytest.approx(0.5)
    assert host_rates(host, 1, 0, 2048)[0] == 1.0  # alone
    assert host_rates(host_model(2, {}), 2, 0, 2048)[0] == 1.0  # not probed: exponent 0
