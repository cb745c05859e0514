"""What the experiments share: where outputs go, a progress bar over runs, JSON and figure writing.

Every experiment writes ``<out>/<name>.json`` (its figures, the paper's beside them, and the settings) and one or
more PNG plots, and returns the JSON object. ``first`` cuts the trace to its first requests (for smoke tests;
the figures in the docs come from the whole trace).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from mooncake_jax.sim.metrics import to_json_text  # noqa: E402
from mooncake_jax.sim.simulate import simulate  # noqa: E402

PAPER_NODE = "8xA800"
PAPER_MODEL = "llama2-70b"
MHA_MODEL = "llama-65b"
"""Multi-head-attention model (8x the KV per token): the configuration in which decode, not only prefill, binds."""


class Runs:
    """Runs simulations for one experiment with a progress bar over them; remembers their summaries."""

    def __init__(self, name: str, total: int, first: int | None, progress: bool):
        self.first = first
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=name, unit="run")

    def __call__(self, **kwargs) -> dict:
        return self.result(**kwargs).summary

    def result(self, **kwargs):
        result = simulate(first=self.first, **kwargs)
        if self._bar is not None:
            self._bar.update(1)
        return result

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def runs(name: str, total: int, first: int | None, progress: bool):
    r = Runs(name, total, first, progress)
    try:
        yield r
    finally:
        r.close()


def write_json(out_dir: Path, name: str, payload: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(to_json_text(payload))
    return path


def save_figure(fig, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pick(summary: dict, *keys: str) -> dict:
    """The named figures of a run summary."""
    return {k: summary.get(k) for k in keys}


def capacity_search(sim, target: float, speed_range: tuple[float, float], steps: int, **cluster) -> dict:
    """Highest speed factor at which ``sim(speed=..., **cluster)`` reaches SLO attainment >= ``target``
    (bisection in log space over ``speed_range``); ``tried`` maps each speed to its attainment and ``summary`` is
    the run at the speed returned (None when even the slowest fails)."""
    lo, hi = speed_range
    tried, summaries = {}, {}

    def ok(speed: float) -> bool:
        summary = sim(speed=speed, **cluster)
        tried[f"{speed:.4g}"] = summary["slo_attainment"]
        summaries[speed] = summary
        return summary["slo_attainment"] >= target

    if ok(hi):
        return {"speed": hi, "saturated": True, "tried": tried, "summary": summaries[hi]}
    if not ok(lo):
        return {"speed": 0.0, "saturated": False, "tried": tried, "summary": summaries[lo]}
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"speed": lo, "saturated": False, "tried": tried, "summary": summaries[lo]}
