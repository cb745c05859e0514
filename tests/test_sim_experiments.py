"""The simulate command, experiments on a slice of the trace, hardware profiles, and simulation speed."""

import json

import pytest

from mooncake_jax import cli
from mooncake_jax.conductor import HARDWARE, instance_costs
from mooncake_jax.conductor.profile import build_profile
from mooncake_jax.sim import simulate
from mooncake_jax.sim.experiments import EXPERIMENTS, run_experiment
from mooncake_jax.sim.hardware import resolve_costs


def test_simulate_command_writes_the_summary(tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert cli.main(["simulate", "--first", "300", "--policy", "local-cache-aware", "--json", str(out),
                     "--no-progress"]) == 0
    written = json.loads(out.read_text())
    assert written["requests"] == 300 and written["completed"] == 300
    assert written["config"]["policy"] == "local-cache-aware"
    assert "avg_ttft_s" in capsys.readouterr().out
    assert cli.main(["simulate", "--first", "10", "--trace", "nope", "--no-progress"]) == 2
    assert "unknown trace" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_each_experiment_writes_json_and_plots_on_a_slice(name, tmp_path):
    payload = run_experiment(name, tmp_path, first=150, progress=False)
    stem = name.replace("-", "_")
    assert json.loads((tmp_path / f"{stem}.json").read_text())["experiment"] == name
    pngs = list(tmp_path.glob("*.png"))
    assert pngs and all(p.stat().st_size > 10_000 for p in pngs)
    if name == "scheduling":
        assert set(payload["ours"]) == {"random", "load-balance", "local-cache-aware", "kvcache-centric"}
    if name == "overload":
        assert set(payload["at_2x"]["paper"]) == {"baseline", "early", "predictive"}
    if name == "pd-ratio":
        assert payload["best"]["llama2-70b"]["best_split"]
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiment("fig99", tmp_path)


def test_measured_profile_and_heterogeneous_pools(tmp_path):
    a800 = instance_costs("8xA800", "llama2-70b")
    points = [(n, p, float(a800.prefill.seconds(n, p)) * 1.5) for n in (512, 2048, 8192, 16384)
              for p in (0, n // 2)]
    decode = [(b, c, float(a800.decode.step_seconds(b, c))) for b in (1, 8, 32) for c in (1000, 100_000)]
    profile = build_profile("slow-a800", "llama2-70b", points, decode, kv_bytes_per_token=a800.kv_bytes_per_token,
                            nic_bytes_per_s=a800.nic_bytes_per_s, kv_capacity_tokens=a800.kv_capacity_tokens,
                            cost_per_hour=10.0)
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    costs = resolve_costs(str(path), "ignored")
    assert costs.prefill.seconds(8192, 0) == pytest.approx(1.5 * a800.prefill.seconds(8192, 0), rel=0.01)
    base = simulate(prefill=4, decode=2, first=400).summary
    slow = simulate(prefill=4, decode=2, first=400, prefill_hardware=str(path)).summary
    fast = simulate(prefill=4, decode=2, first=400, prefill_hardware="8xH800").summary
    assert slow["avg_prefill_s"] == pytest.approx(1.5 * base["avg_prefill_s"], rel=0.02)
    assert fast["avg_ttft_s"] < base["avg_ttft_s"] < slow["avg_ttft_s"]
    hourly = 4 * 10.0 + 2 * HARDWARE["8xA800"].cost_per_hour
    assert slow["cluster_cost_per_hour"] == hourly
    assert slow["cost_per_request"] == pytest.approx(hourly * slow["sim_duration_s"] / 3600 / slow["completed"])


def test_whole_trace_on_sixteen_nodes_is_fast():
    summary = simulate("conversation", prefill=8, decode=8).summary
    assert summary["requests"] == summary["completed"] == 12031
    assert summary["wall_s"] < 30.0
