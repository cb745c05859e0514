"""Cost models, their fits, datasheet profiles and the measured-profile JSON and command."""

import argparse
import json
import sys
import types

import numpy as np
import pytest

from mooncake_jax.conductor import HARDWARE, MODEL_SHAPES, DecodeCost, PrefillCost, instance_costs
from mooncake_jax.conductor import profile as prof
from mooncake_jax.conductor.costs import (fast25_flops, fit_decode, fit_prefill_fast25, fit_prefill_poly,
                                          prefill_seconds_in_prefix, transfer_seconds)


def grid(fn):
    return [(n, p, fn(n, p)) for n in (64, 256, 1024, 4096) for p in (0, n // 4, n // 2, n - 1)]


def test_prefill_and_decode_formulas_by_hand():
    cost = PrefillCost((0.1, 1e-3, 1e-6, 2e-6))
    # x = 600 new tokens after p = 400: 0.1 + 0.6 + 0.36 + 2e-6 * 600 * 400 = 1.54
    assert cost.seconds(1000, 400) == pytest.approx(1.54)
    fast = PrefillCost.fast25(layers=2, d_model=10, flops_per_s=1e6)
    # flops(100) = 2 * (4 * 100^2 * 10 + 22 * 100 * 10^2) = 1.24e6; minus flops(50) = 2 * (1e5 + 1.1e5)
    assert fast.seconds(100, 0) == pytest.approx(1.24)
    assert fast.seconds(100, 50) == pytest.approx(1.24 - 0.42)
    assert DecodeCost((0.01, 0.002, 1e-6)).step_seconds(4, 10_000) == pytest.approx(0.01 + 0.008 + 0.01)
    assert transfer_seconds(1e9, 1e10, backlog_s=0.5) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="non-negative"):
        PrefillCost((0.0, -1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="3 coefficients"):
        DecodeCost((1.0, 2.0))


def test_prefix_quadratic_form_equals_the_model_for_every_instance():
    rng = np.random.default_rng(2)
    coef = rng.uniform(0, 1e-3, (4, 7))  # seven instances with their own models
    a, b, c = prefill_seconds_in_prefix(coef, 5000)
    for p in (0, 1, 1234, 4999):
        expected = [PrefillCost(coef[:, s]).seconds(5000, p) for s in range(7)]
        assert a + b * p + c * p * p == pytest.approx(expected, rel=1e-12)


def test_polynomial_fit_recovers_known_coefficients():
    truth = PrefillCost((0.02, 3e-4, 2e-8, 1e-8))
    fit = fit_prefill_poly(grid(truth.seconds))
    assert fit.coef == pytest.approx(truth.coef, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_err < 1e-9 and fit.n_points == 16


def test_fast25_fit_recovers_effective_flops_and_efficiency():
    truth = PrefillCost.fast25(layers=4, d_model=128, flops_per_s=5e10, overhead_s=0.003)
    fit = fit_prefill_fast25(grid(truth.seconds), layers=4, d_model=128, peak_flops_per_s=1e11)
    assert fit.params["effective_flops_per_s"] == pytest.approx(5e10, rel=1e-6)
    assert fit.params["efficiency"] == pytest.approx(0.5, rel=1e-6)
    assert fit.coef == pytest.approx(truth.coef, rel=1e-6) and fit.max_rel_err < 1e-9


def test_noisy_fit_reports_its_error_and_keeps_coefficients_non_negative():
    rng = np.random.default_rng(1)
    truth = PrefillCost((0.0, 1e-4, 1e-8, 0.0))
    noisy = [(n, p, t * (1 + rng.uniform(-0.1, 0.1))) for n, p, t in grid(truth.seconds)]
    fit = fit_prefill_poly(noisy)
    worst = max(abs(t - truth.seconds(n, p)) / t for n, p, t in noisy)
    assert 0.0 < fit.mean_rel_err <= fit.max_rel_err < 0.25 and worst > 0.05
    assert min(fit.coef) >= 0 and fit.r2 < 1.0
    # A constant-only truth: unconstrained least squares would trade a negative slope against the intercept.
    flat = fit_prefill_poly([(n, p, 1.0 + (0.01 if n == 64 else 0.0)) for n, p, _ in grid(truth.seconds)])
    assert min(flat.coef) >= 0


def test_decode_fit_and_bad_points():
    truth = DecodeCost((0.005, 1e-4, 2e-8))
    points = [(b, c, truth.step_seconds(b, c)) for b in (1, 4, 16, 64) for c in (1_000, 50_000, 400_000)]
    fit = fit_decode(points)
    assert fit.coef == pytest.approx(truth.coef, rel=1e-6)
    with pytest.raises(ValueError, match="at least 4"):
        fit_prefill_poly([(10, 0, 1.0)])
    with pytest.raises(ValueError, match="positive"):
        fit_decode(points[:-1] + [(1, 0, -1.0)])
    with pytest.raises(ValueError, match="prefix_tokens < n_tokens"):
        fit_prefill_poly([(10, 10, 1.0)] * 4)
    with pytest.raises(ValueError, match="triples"):
        fit_decode([(1, 2)])


def test_datasheet_profile_of_the_papers_node():
    costs = instance_costs("8xA800", "llama2-70b")
    shape, node = MODEL_SHAPES["llama2-70b"], HARDWARE["8xA800"]
    assert costs.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2 == 320 * 1024
    assert costs.kv_bytes_per_token * 512 == 160 * 2**20  # one 512-token block: 160 MiB
    effective = 8 * 312e12 * node.prefill_efficiency
    assert costs.prefill.seconds(8000, 0) == pytest.approx(fast25_flops(8000, 0, 80, 8192) / effective)
    assert costs.decode.coef[0] == pytest.approx(shape.param_bytes / (8 * 2.039e12 * node.decode_efficiency))
    assert costs.kv_capacity_tokens == int((640e9 * 0.9 - shape.param_bytes) // (320 * 1024))
    assert costs.nic_bytes_per_s == 100e9  # 800 Gbps
    assert 60e9 < shape.param_count < 72e9
    with pytest.raises(ValueError, match="does not fit"):
        instance_costs("tpu-v5e-8", "llama2-70b")
    with pytest.raises(ValueError, match="unknown hardware"):
        instance_costs("abacus", "llama2-70b")
    assert {"8xA800", "8xH800", "8xH200", "tpu-v5e-8", "tpu-v6e-8"} <= set(HARDWARE)
    assert all(h.source for h in HARDWARE.values())


def test_model_shapes_agree_with_the_engine_presets():
    config = pytest.importorskip("mooncake_jax.model.config")
    from mooncake_jax.conductor import ModelShape

    for name, shape in MODEL_SHAPES.items():
        engine = config.PRESETS[name]
        assert ModelShape.from_model_config(engine) == shape
        assert shape.kv_bytes_per_token == engine.kv_bytes_per_token()
        assert shape.param_count == engine.param_count()


def unit_profile():
    truth_p = PrefillCost((0.001, 2e-5, 1e-8, 0.0))
    truth_d = DecodeCost((0.002, 1e-4, 1e-7))
    decode_points = [(b, c, truth_d.step_seconds(b, c)) for b in (1, 2, 8) for c in (100, 1000, 5000)]
    return prof.build_profile("unit@test", "unit", grid(truth_p.seconds), decode_points, kv_bytes_per_token=4096,
                              nic_bytes_per_s=1e9, kv_capacity_tokens=50_000), truth_p, truth_d


def test_profile_json_round_trip_and_bad_profiles(tmp_path):
    profile, truth_p, truth_d = unit_profile()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    costs = prof.load_profile(path)
    assert costs.prefill.coef == pytest.approx(truth_p.coef, rel=1e-6)
    assert costs.decode.coef == pytest.approx(truth_d.coef, rel=1e-6)
    assert (costs.kv_bytes_per_token, costs.kv_capacity_tokens, costs.name) == (4096, 50_000, "unit@test")
    assert "prefill poly *" in prof.fit_report(profile)
    with pytest.raises(ValueError, match="not valid JSON"):
        prof.costs_from_profile("{")
    with pytest.raises(ValueError, match="not a cost profile"):
        prof.costs_from_profile({"format": "other"})
    broken = dict(profile, decode={})
    with pytest.raises(ValueError, match="lacks"):
        prof.costs_from_profile(broken)
    with pytest.raises(ValueError, match="no profile file"):
        prof.load_profile(tmp_path / "missing.json")


def parse(argv):
    parser = argparse.ArgumentParser()
    prof.add_arguments(parser)
    return parser.parse_args(argv)


def test_profile_command_without_the_engine_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mooncake_jax.model.measure", None)  # import raises ImportError
    assert prof.run(parse([])) == 2
    assert "mooncake_jax.model.measure" in capsys.readouterr().err


def test_profile_command_measures_fits_and_writes(monkeypatch, tmp_path, capsys):
    truth = PrefillCost.fast25(layers=4, d_model=128, flops_per_s=2e10, overhead_s=0.002)
    per_step = DecodeCost((0.003, 2e-4, 5e-8))
    calls = []

    def measure_prefill(model, n_tokens, prefix_tokens):
        calls.append((model, n_tokens, prefix_tokens))
        return truth.seconds(n_tokens, prefix_tokens)

    def measure_decode_step(model, batch, context_tokens):  # context per sequence
        return per_step.step_seconds(batch, batch * context_tokens)

    fake = types.ModuleType("mooncake_jax.model.measure")
    fake.measure_prefill, fake.measure_decode_step = measure_prefill, measure_decode_step
    monkeypatch.setitem(sys.modules, "mooncake_jax.model.measure", fake)
    out = tmp_path / "prof.json"
    args = parse(["--model", "fake-model", "--out", str(out), "--layers", "4", "--d-model", "128",
                  "--kv-bytes-per-token", "2048", "--repeats", "2", "--prefill-tokens", "64,256,1024",
                  "--prefix-fractions", "0,0.5", "--peak-gflops", "40"])
    assert prof.run(args) == 0
    assert len(calls) == 2 * 3 * 2 and calls[0][0] == "fake-model"
    profile = json.loads(out.read_text())
    fast25 = profile["prefill"]["fits"]["fast25"]
    assert fast25["params"]["effective_flops_per_s"] == pytest.approx(2e10, rel=1e-6)
    assert fast25["params"]["efficiency"] == pytest.approx(0.5, rel=1e-6)
    costs = prof.costs_from_profile(profile)
    assert costs.prefill.seconds(700, 100) == pytest.approx(truth.seconds(700, 100), rel=1e-6)
    assert costs.decode.coef == pytest.approx(per_step.coef, rel=1e-6)
    assert costs.kv_bytes_per_token == 2048
    assert "wrote" in capsys.readouterr().out
