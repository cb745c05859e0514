"""Where the sim-to-real prefill reading misses, from the token files of ``benchmarks/sim_to_real.py`` runs (no
cluster): per run, the engine compute its instances reported over the start-up profile's prediction, in the bursts
(the probe a minute before the replay) and in the replay, for prompts under and over 1,024 new tokens, and how much
of the long prompts' compute ran beside another prefill, and the profile reading's TTFT error as it is and with
its prefill engine scaled by the replay's compute over the bursts' (read from the replay: no prediction, how much of
the miss the engine's level explains); with two or more runs, the first two re-simulated (the
profile reading, ``from_profile``) with one input taken from the other run: its start-up profile, its bursts, its
other probes. Twelfth pass (docs/benchmarks/sim.md): the bursts, not the start-up profile, set the simulated TTFT.
Thirteenth pass: the contention probe's pair slowdown at each length and the fitted ``host_pair_exponent`` where the
run read them, and each TTFT reading also with the host's length dependence left out (``_no_length``).

    python benchmarks/sim_to_real_diagnose.py docs/sim/sim_to_real_s11_xeon_quiet_{1,2}_tokens.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import sim_to_real  # noqa: E402
from sim_real.host_fit import pair_length_exponent  # noqa: E402
from sim_real.live import trace_slice  # noqa: E402
from sim_real.readings import from_profile, host_variant  # noqa: E402

from mooncake_jax.conductor.accounting import prefill_work_s  # noqa: E402
from mooncake_jax.conductor.profile import costs_from_profile  # noqa: E402
from mooncake_jax.demo import ENGINE_BLOCK  # noqa: E402
from mooncake_jax.model.config import PRESETS  # noqa: E402
from mooncake_jax.sim.host import cfs_weight  # noqa: E402

LONG_TOKENS = 1024  # new tokens from which a prompt counts as long
BANDS = {"short": (0, LONG_TOKENS), "long": (LONG_TOKENS, 1 << 30), "all": (0, 1 << 30)}
SAMPLES = 80  # points per compute interval at which the overlap with other prefills is read


def compute_over_profile(rows, costs, lo: int, hi: int) -> float | None:
    """Sum of reported compute over the sum of the profile's predictions, for prompts of ``lo``-``hi`` new tokens
    (``rows``: (prompt tokens, cached tokens, compute s))."""
    sel = [(c, prefill_work_s(costs.prefill, n, k)) for n, k, c in rows if lo <= n - min(k, n - 1) < hi]
    return float(sum(c for c, _ in sel) / sum(p for _, p in sel)) if sel else None


def overlapped(intervals) -> float | None:
    """Mean share of each long prompt's compute interval during which another prefill computed
    (``intervals``: (new tokens, begin, end))."""
    shares = []
    for k, (n, a, b) in enumerate(intervals):
        if n < LONG_TOKENS or b <= a:
            continue
        t = a + (b - a) * (np.arange(SAMPLES) + 0.5) / SAMPLES
        others = [(x, y) for j, (_, x, y) in enumerate(intervals) if j != k]
        shares.append(float(np.mean([any(x <= s < y for x, y in others) for s in t])))
    return float(np.mean(shares)) if shares else None


def run_figures(measured: dict, items) -> dict:
    costs = costs_from_profile(measured["profile_json"])
    bursts = [(n, k, c) for n, k, _, c in measured["burst_engine"]]
    replay = [(len(it[1]), r["cached_tokens"], r["compute_s"]) for it, r in zip(items, measured["replay"]) if r]
    figures = {}
    for band, (lo, hi) in BANDS.items():
        figures[f"bursts_{band}"] = compute_over_profile(bursts, costs, lo, hi)
        figures[f"replay_{band}"] = compute_over_profile(replay, costs, lo, hi)
    figures["bursts_long_overlapped"] = overlapped([(n - k, b, b + c) for n, k, b, c in measured["burst_engine"]])
    probed = measured["overheads"]  # the contention probe's pairs over lengths (thirteenth pass), where read
    for n in (256, 512, 1024, 2048):
        suffix = "" if n == 512 else f"_{n}"
        alone = probed.get(f"contention_compute_s_alone{suffix}")
        pair = probed.get(f"contention_compute_s_pair{suffix}")
        if alone and pair:
            figures[f"contention_pair_over_alone_{n}"] = pair / alone
    if probed.get("contention_compute_s_long_beside_short") and probed.get("contention_compute_s_alone_2048"):
        figures["contention_long_beside_short_over_alone_2048"] = (probed["contention_compute_s_long_beside_short"]
                                                                   / probed["contention_compute_s_alone_2048"])
    exponent = pair_length_exponent(probed)  # as this code fits it (the run may have recorded an earlier fit)
    if exponent is not None:
        figures["host_pair_exponent"] = exponent
    figures["replay_long_overlapped"] = overlapped([
        (len(it[1]) - r["cached_tokens"], r["submitted"] + r["decided_s"] + r["queue_s"],
         r["submitted"] + r["decided_s"] + r["queue_s"] + r["compute_s"])
        for it, r in zip(items, measured["replay"]) if r])
    return figures


def simulated_ttft(measured: dict, items, profile_from: dict, bursts_from: dict, probes_from: dict,
                   engine_scale: float = 1.0, pair_exponent: float | None = None) -> list[float]:
    """TTFT p50, p90 of the profile reading with the start-up profile, the bursts and the other probes each taken
    from the given run (the replay's arrivals and completions from ``measured``), its prefill engine times
    ``engine_scale``; ``pair_exponent``: the host's slowdown of a prefill beside another over its length set to
    this (0: every length alike, the twelfth pass's host) instead of the probed one."""
    costs = costs_from_profile(profile_from["profile_json"])
    runs = [(start, n, np.array(times)) for start, n, times in bursts_from["bursts"]]
    engine = [tuple(e) for e in bursts_from["burst_engine"]]
    probed = dict(probes_from["overheads"])
    probed.setdefault("host_prefill_cfs_weight", cfs_weight(5))
    changes = {} if pair_exponent is None else {"host_pair_exponent": pair_exponent}  # (else refitted there)
    probed = host_variant(probed, costs, engine, runs, 2, 2, **changes)
    inputs = from_profile(costs, probed, 2)
    inputs["prefill_coef"] = [c * engine_scale for c in inputs["prefill_coef"]]
    _, by_item = sim_to_real.simulated(items, costs, inputs, 2, 1, 1.0, 8192 * ENGINE_BLOCK,
                                       {"ttft_slo_s": 30.0, "tbt_slo_s": 1.0})
    ttft = [by_item[i].ttft_s for i, r in enumerate(measured["replay"]) if r is not None]
    return [float(v) for v in np.percentile(ttft, [50, 90])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("token_files", type=Path, nargs="+", help="--token-times files of sim_to_real.py runs")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    for path in args.token_files:
        if not path.is_file():
            parser.error(f"no file {path}")
    cfg = PRESETS["tiny"]
    runs = [json.loads(p.read_text()) for p in args.token_files]
    items = [trace_slice(len(m["replay"]), cfg.vocab_size, cfg.max_seq_len) for m in runs]
    out = {}
    for path, m, its in zip(args.token_files, runs, items):
        out[path.name] = figures = run_figures(m, its)
        real = np.percentile([r["times"][0] for r in m["replay"] if r is not None], [50, 90])
        scale = figures["replay_all"] / figures["bursts_all"]
        for label, k, exponent in (("", 1.0, None), ("_engine_at_replay_level", scale, None),
                                   ("_no_length", 1.0, 0.0), ("_no_length_engine_at_replay_level", scale, 0.0)):
            sim = simulated_ttft(m, its, m, m, m, k, exponent)
            figures[f"ttft_p50_rel_err{label}"], figures[f"ttft_p90_rel_err{label}"] = (
                float(abs(x - r) / r) for x, r in zip(sim, real))
        print(path.name, {k: None if v is None else round(v, 2) for k, v in figures.items()})
    if len(runs) >= 2:
        for (a, ia), b in (((runs[0], items[0]), runs[1]), ((runs[1], items[1]), runs[0])):
            name = args.token_files[0 if a is runs[0] else 1].name
            swaps = {"as_is": simulated_ttft(a, ia, a, a, a),
                     "other_profile": simulated_ttft(a, ia, b, a, a),
                     "other_bursts": simulated_ttft(a, ia, a, b, a),
                     "other_probes": simulated_ttft(a, ia, a, a, b)}
            out[f"{name}_simulated_ttft_p50_p90"] = swaps
            print(name, "simulated TTFT p50 / p90 (s):", {k: [round(x, 3) for x in v] for k, v in swaps.items()})
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
