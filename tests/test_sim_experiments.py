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
    if name == "hetero":
        v5e = payload["results"]["llama2-70b"]["tpu-v5e-8 prefill + tpu-v6e-8 decode"]
        assert not v5e["fits"] and "tpu-v5e-8" in v5e["reason"]
        a800 = payload["results"]["llama2-70b"]["all 8xA800"]
        assert a800["fits"] and a800["cluster_cost_per_hour"] == 16 * HARDWARE["8xA800"].cost_per_hour
        assert all(r["fits"] for r in payload["results"]["llama2-7b"].values())
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


def test_mixed_pools_give_each_instance_its_own_costs_and_cost_per_token():
    from mooncake_jax.sim.config import SimConfig
    from mooncake_jax.sim.hardware import parse_pool

    assert parse_pool("8xA800") == "8xA800"
    assert parse_pool("8xH800*2,8xA800") == ("8xH800", "8xH800", "8xA800")
    assert parse_pool("tpu-v6e-8*1") == ("tpu-v6e-8",)
    for bad in ("8xH800*0", "8xH800*x", ",8xA800"):
        with pytest.raises(ValueError, match="hardware"):
            parse_pool(bad)
    with pytest.raises(ValueError, match="prefill_hardware lists 2 instances' hardware for a pool of 3"):
        SimConfig(prefill=3, decode=1, prefill_hardware=["8xH800", "8xA800"])
    with pytest.raises(ValueError, match="8xB999"):
        simulate(prefill=2, decode=1, first=5, prefill_hardware=["8xH800", "8xB999"])
    config = SimConfig(prefill=3, decode=2, prefill_hardware=["8xH800", "8xA800", "8xH800"],
                       decode_hardware="tpu-v6e-8")
    prefill, decode = config.pool_costs()
    assert [c.hardware for c in prefill] == ["8xH800", "8xA800", "8xH800"]
    assert [c.hardware for c in decode] == ["tpu-v6e-8"] * 2
    result = simulate(prefill=3, decode=2, first=300, prefill_hardware=["8xH800", "8xA800", "8xH800"],
                      decode_hardware="tpu-v6e-8")
    s = result.summary
    hourly = 2 * HARDWARE["8xH800"].cost_per_hour + HARDWARE["8xA800"].cost_per_hour \
        + 2 * HARDWARE["tpu-v6e-8"].cost_per_hour
    assert s["cluster_cost_per_hour"] == pytest.approx(hourly)
    done = [r for r in result.requests if r.status == "completed"]
    tokens = sum(r.input_tokens + r.output_tokens for r in done)
    assert s["completed_tokens"] == tokens
    assert s["cost_per_million_tokens"] == pytest.approx(hourly * s["sim_duration_s"] / 3600 / tokens * 1e6)
    assert result.config["prefill_hardware"] == ["8xH800", "8xA800", "8xH800"]
    # the faster prefill instances take the requests while their queues are shorter: both kinds get work
    by_node = {r.prefill_id for r in done}
    assert by_node == {"p0", "p1", "p2"}
