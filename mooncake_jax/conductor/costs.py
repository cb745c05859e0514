"""Cost models the Conductor predicts with: prefill time, decode step time and KV transfer time.

Every model is *linear in a few fixed features*. That one choice buys three things: a single weighted
least-squares routine fits both the free polynomial and the FAST'25 FLOP form; coefficients of many instances
stack into one array, so a heterogeneous cluster is evaluated in one numpy expression per decision; and a profile
measured on a real engine and one derived from a datasheet are the same kind of object.

Prefill features, with ``x = n - p`` new tokens after ``p`` cached prefix tokens: ``(1, x, x^2, x*p)``.
The FAST'25 form ``flops(n) = l*(a*n^2*d + b*n*d^2)`` done incrementally is ``flops(n) - flops(p)`` =
``l*(b*d^2*x + a*d*x^2 + 2*a*d*x*p)``: the same features with two free parameters instead of four.

Decode features: ``(1, batch, context_tokens)``: weights are read once per step, each request adds its matmul
work, each cached token adds its KV read.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import numpy as np

FAST25_A = 4.0
"""FAST'25's attention coefficient in flops(n) = l*(a*n^2*d + b*n*d^2)."""
FAST25_B = 22.0
"""FAST'25's linear-layer coefficient in the same formula."""


def prefill_seconds(coef, n_tokens, prefix_tokens):
    """Predicted prefill time of ``n_tokens`` with ``prefix_tokens`` already cached.

    ``coef`` is one model's 4 coefficients (shape ``(4,)``) or a stack of them (shape ``(4, S)``, one column per
    instance); ``n_tokens``/``prefix_tokens`` broadcast against the columns.
    """
    x = n_tokens - prefix_tokens
    return coef[0] + coef[1] * x + coef[2] * x * x + coef[3] * x * prefix_tokens


def prefill_seconds_in_prefix(coef, n_tokens) -> np.ndarray:
    """Prefill time of an ``n_tokens`` prompt as a quadratic in its cached prefix p: rows (a, b, c) with
    seconds = a + b*p + c*p^2, one column per instance of a ``(4, S)`` stack.

    Substituting x = n - p into the features once per request turns the evaluation for every instance and every
    candidate prefix into one small matrix product and a few array operations.
    """
    n = float(n_tokens)
    basis = np.array(((1.0, n, n * n, 0.0), (0.0, -1.0, -2.0 * n, n), (0.0, 0.0, 1.0, -1.0)))
    return np.dot(basis, coef)


def decode_step_seconds(coef, batch, context_tokens):
    """Predicted time of one decode iteration over ``batch`` requests holding ``context_tokens`` in all."""
    return coef[0] + coef[1] * batch + coef[2] * context_tokens


def transfer_seconds(n_bytes, bytes_per_s, backlog_s=0.0):
    """Time until ``n_bytes`` have arrived over a link of ``bytes_per_s``: the link's queued transfers first
    (``backlog_s``, never negative), then the bytes at line rate.

    The one transfer-time formula of the system: the policy's fetch prediction, the cluster state's sender
    backlog and the simulator's links all call it. Scalars or arrays (one entry per destination) broadcast.
    """
    if isinstance(bytes_per_s, np.ndarray):  # a table's link row: validated when each link was set
        return np.maximum(backlog_s, 0.0) + n_bytes / bytes_per_s
    if not bytes_per_s > 0:
        raise ValueError(f"bandwidth must be positive, got {bytes_per_s}")
    # Python numbers first: ``np.ndim`` costs about half a microsecond a call (the decision path calls this twice)
    if (isinstance(backlog_s, (int, float)) and isinstance(n_bytes, (int, float))
            or np.ndim(backlog_s) == 0 and np.ndim(n_bytes) == 0):
        return max(float(backlog_s), 0.0) + n_bytes / bytes_per_s
    return np.maximum(backlog_s, 0.0) + np.divide(n_bytes, bytes_per_s)


def link_bytes_per_s(sender_nic_bytes_per_s, receiver_nic_bytes_per_s):
    """Default bandwidth of a sender -> receiver link: the slower of the two NICs (an explicit per-pair
    figure, ``ClusterState.set_link``, overrides it)."""
    return np.minimum(sender_nic_bytes_per_s, receiver_nic_bytes_per_s)


def fast25_flops(n_tokens, prefix_tokens, layers: int, d_model: int, a: float = FAST25_A, b: float = FAST25_B):
    """FLOPs of an incremental prefill in the FAST'25 form: flops(n) - flops(prefix)."""
    n, p = n_tokens, prefix_tokens
    return layers * (a * (n * n - p * p) * d_model + b * (n - p) * d_model * d_model)


def _as_coef(values: Sequence[float], size: int, what: str) -> tuple[float, ...]:
    coef = tuple(float(v) for v in values)
    if len(coef) != size:
        raise ValueError(f"{what} needs {size} coefficients, got {len(coef)}")
    if not all(np.isfinite(coef)) or min(coef) < 0:
        raise ValueError(f"{what} coefficients must be finite and non-negative, got {coef}")
    return coef


@dataclasses.dataclass(frozen=True)
class PrefillCost:
    """Prefill time model: seconds = c0 + c1*x + c2*x^2 + c3*x*p (x new tokens, p cached prefix tokens).

    ``chunk_buckets``: the lengths the engine pads each prefill chunk to (ascending, the last one the chunk size;
    empty when it computes exactly the new tokens). An engine that compiles one program per bucket computes 512
    tokens for a 300-token prompt: the work of a prefill (``accounting.prefill_work_s``) counts those.
    """

    coef: tuple[float, float, float, float]
    chunk_buckets: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "coef", _as_coef(self.coef, 4, "PrefillCost"))
        buckets = tuple(int(b) for b in self.chunk_buckets)
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"PrefillCost chunk_buckets must be ascending positive token counts, got "
                             f"{self.chunk_buckets!r}")
        object.__setattr__(self, "chunk_buckets", buckets)

    def computed_tokens(self, new_tokens: int) -> int:
        """New tokens as the engine computes them: whole chunks, then the last one padded to its bucket."""
        if not self.chunk_buckets:
            return new_tokens
        chunk = self.chunk_buckets[-1]
        full, rest = divmod(int(new_tokens), chunk)
        return full * chunk + (next(b for b in self.chunk_buckets if b >= rest) if rest else 0)

    @classmethod
    def fast25(cls, layers: int, d_model: int, flops_per_s: float, overhead_s: float = 0.0,
               a: float = FAST25_A, b: float = FAST25_B) -> "PrefillCost":
        """The FAST'25 FLOP form at an effective (already efficiency-scaled) FLOP rate."""
        if flops_per_s <= 0:
            raise ValueError(f"flops_per_s must be positive, got {flops_per_s}")
        k = layers / flops_per_s
        return cls((overhead_s, k * b * d_model * d_model, k * a * d_model, 2 * k * a * d_model))

    def seconds(self, n_tokens, prefix_tokens=0):
        return prefill_seconds(self.coef, n_tokens, prefix_tokens)


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    """Decode iteration time model: seconds = c0 + c1*batch + c2*context_tokens."""

    coef: tuple[float, float, float]

    def __post_init__(self):
        object.__setattr__(self, "coef", _as_coef(self.coef, 3, "DecodeCost"))

    def step_seconds(self, batch, context_tokens):
        return decode_step_seconds(self.coef, batch, context_tokens)


@dataclasses.dataclass(frozen=True)
class InstanceCosts:
    """What one instance (a hardware + model pair) costs: everything the Conductor predicts its times from.

    ``kv_capacity_tokens`` is the KV a decode instance can hold in device memory; ``nic_bytes_per_s`` bounds
    the transfers it sends and receives; ``cost_per_hour`` lets the simulator report cost per request.
    ``hardware`` names the kind of hardware (``8xA800``, ``tpu-v5e-8``, or what a measured profile ran on).
    """

    name: str
    prefill: PrefillCost
    decode: DecodeCost
    kv_bytes_per_token: float
    nic_bytes_per_s: float
    kv_capacity_tokens: int
    cost_per_hour: float = 0.0
    hardware: str = ""

    def __post_init__(self):
        if self.kv_bytes_per_token <= 0 or self.nic_bytes_per_s <= 0:
            raise ValueError(f"{self.name}: kv_bytes_per_token and nic_bytes_per_s must be positive")
        if self.kv_capacity_tokens < 0 or self.cost_per_hour < 0:
            raise ValueError(f"{self.name}: kv_capacity_tokens and cost_per_hour must be non-negative")

    def replace(self, **changes) -> "InstanceCosts":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------- fitting


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted linear cost model and how well it matches the points it came from.

    ``r2`` is the coefficient of determination of the times; the relative errors are |predicted - measured| /
    measured over the points, which is what matters for a scheduler comparing short and long requests alike.
    ``params`` holds form-specific figures (e.g. the effective FLOP/s of the FAST'25 form).
    """

    form: str
    coef: tuple[float, ...]
    r2: float
    max_rel_err: float
    mean_rel_err: float
    n_points: int
    params: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"coef": list(self.coef)}


def _nonneg_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, exactly, by trying each subset of columns.

    Cost models have at most four columns (16 subsets), so the exhaustive search is cheaper to trust than an
    iterative NNLS; negative coefficients would predict negative times for small requests.
    """
    n_cols = features.shape[1]
    best, best_err = np.zeros(n_cols), float(np.sum(target**2))
    for size in range(1, n_cols + 1):
        for cols in itertools.combinations(range(n_cols), size):
            sol, *_ = np.linalg.lstsq(features[:, cols], target, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((features[:, cols] @ sol - target) ** 2))
            if err < best_err - 1e-15 * max(best_err, 1e-300):
                best = np.zeros(n_cols)
                best[list(cols)] = sol
                best_err = err
    return best


def _fit_linear(form: str, features: np.ndarray, seconds: np.ndarray, min_points: int) -> tuple[np.ndarray, Fit]:
    """Fit ``seconds ~ features @ coef`` minimising *relative* error, and score it."""
    if len(seconds) < min_points:
        raise ValueError(f"{form}: need at least {min_points} measured points, got {len(seconds)}")
    if not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise ValueError(f"{form}: measured times must be finite and positive")
    weights = 1.0 / seconds
    coef = _nonneg_lstsq(features * weights[:, None], seconds * weights)
    predicted = features @ coef
    rel = np.abs(predicted - seconds) / seconds
    total = float(np.sum((seconds - seconds.mean()) ** 2))
    r2 = 1.0 - float(np.sum((predicted - seconds) ** 2)) / total if total > 0 else float(np.allclose(rel, 0))
    fit = Fit(form, tuple(float(c) for c in coef), r2, float(rel.max()), float(rel.mean()), len(seconds))
    return coef, fit


def _points(points: Iterable[Sequence[float]], what: str) -> np.ndarray:
    arr = np.asarray(list(points), dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"{what} points must be (a, b, seconds) triples, got shape {arr.shape}")
    return arr


def _prefill_points(points) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arr = _points(points, "prefill")
    n, p, t = arr.T
    if np.any(n < 1) or np.any(p < 0) or np.any(p >= n):
        raise ValueError("prefill points need n_tokens >= 1 and 0 <= prefix_tokens < n_tokens")
    return n, p, t


def fit_prefill_poly(points: Iterable[Sequence[float]]) -> Fit:
    """Fit the 4-coefficient polynomial to (n_tokens, prefix_tokens, seconds) points."""
    n, p, t = _prefill_points(points)
    x = n - p
    _, fit = _fit_linear("poly", np.stack([np.ones_like(x), x, x * x, x * p], axis=1), t, 4)
    return fit


def fit_prefill_fast25(points: Iterable[Sequence[float]], layers: int, d_model: int,
                       a: float = FAST25_A, b: float = FAST25_B, peak_flops_per_s: float | None = None) -> Fit:
    """Fit seconds = overhead + flops_fast25(n, p) / effective_flops to measured points.

    ``params`` reports ``effective_flops_per_s`` and, given the hardware's peak, the ``efficiency``.
    """
    n, p, t = _prefill_points(points)
    flops = fast25_flops(n, p, layers, d_model, a, b)
    coef, fit = _fit_linear("fast25", np.stack([np.ones_like(flops), flops], axis=1), t, 2)
    if coef[1] <= 0:
        raise ValueError("fast25: the measured times do not grow with FLOPs; cannot fit an effective FLOP rate")
    effective = 1.0 / coef[1]
    params = {"layers": layers, "d_model": d_model, "a": a, "b": b, "effective_flops_per_s": effective}
    if peak_flops_per_s:
        params["efficiency"] = effective / peak_flops_per_s
    model = PrefillCost.fast25(layers, d_model, effective, float(coef[0]), a, b)
    return dataclasses.replace(fit, coef=model.coef, params=params)


def fit_decode(points: Iterable[Sequence[float]]) -> Fit:
    """Fit the decode step model to (batch, context_tokens, seconds) points."""
    arr = _points(points, "decode")
    batch, context, t = arr.T
    if np.any(batch < 1) or np.any(context < 0):
        raise ValueError("decode points need batch >= 1 and context_tokens >= 0")
    _, fit = _fit_linear("decode", np.stack([np.ones_like(batch), batch, context], axis=1), t, 3)
    return fit
