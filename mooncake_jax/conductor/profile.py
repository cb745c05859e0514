"""Measured cost profiles: the ``mooncake-jax profile`` command and the profile JSON it writes.

A datasheet profile (``hardware.py``) is a guess at efficiency; a measured one times the local engine on a grid of
prompt lengths, cached prefixes, batch sizes and contexts, fits the cost models to the points (``costs.py``) and
says how well they fit. The JSON keeps the raw points beside the fits so a profile can be refitted or audited
later. Instances register with it (``RegisterRequest.profile_json``) and the simulator loads it by path.

Profile JSON (``"format": "mooncake-jax-profile/1"``)::

    {"format", "name", "model", "created",
     "hardware", "kv_bytes_per_token", "nic_bytes_per_s", "kv_capacity_tokens", "cost_per_hour",
     "prefill": {"points": [[n_tokens, prefix_tokens, seconds], ...],
                 "fits": {"poly": Fit, "fast25": Fit (when the model's shape is known)},
                 "use": "poly" | "fast25"},
     "decode": {"points": [[batch, total_context_tokens, seconds], ...], "fit": Fit}}

where Fit is ``{"form", "coef", "r2", "max_rel_err", "mean_rel_err", "n_points", "params"}`` (``costs.Fit``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from mooncake_jax.conductor.costs import (DecodeCost, InstanceCosts, PrefillCost, fit_decode, fit_prefill_fast25,
                                          fit_prefill_poly)
from mooncake_jax.conductor.hardware import MODEL_SHAPES, ModelShape

FORMAT = "mooncake-jax-profile/1"


def build_profile(name: str, model: str, prefill_points, decode_points, *, kv_bytes_per_token: float,
                  nic_bytes_per_s: float, kv_capacity_tokens: int, cost_per_hour: float = 0.0,
                  layers: int | None = None, d_model: int | None = None,
                  peak_flops_per_s: float | None = None, hardware: str = "measured",
                  chunk_buckets=()) -> dict:
    """Fit the measured points and return the profile JSON object.

    Both prefill forms are fitted when the model's ``layers`` and ``d_model`` are known; the one with the lower
    mean relative error is used. ``chunk_buckets``: the chunk lengths the measured engine pads a prefill to
    (``PrefillCost.chunk_buckets``); measure the grid at those lengths, where padding costs nothing.
    """
    prefill_points = [[float(v) for v in p] for p in prefill_points]
    decode_points = [[float(v) for v in p] for p in decode_points]
    fits = {"poly": fit_prefill_poly(prefill_points)}
    if layers and d_model:
        try:
            fits["fast25"] = fit_prefill_fast25(prefill_points, layers, d_model, peak_flops_per_s=peak_flops_per_s)
        except ValueError:  # times that do not grow with FLOPs (a tiny model, a loaded host): the free form fits
            pass
    use = min(fits, key=lambda form: fits[form].mean_rel_err)
    profile = {
        "format": FORMAT, "name": name, "model": model, "hardware": str(hardware),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kv_bytes_per_token": float(kv_bytes_per_token), "nic_bytes_per_s": float(nic_bytes_per_s),
        "kv_capacity_tokens": int(kv_capacity_tokens), "cost_per_hour": float(cost_per_hour),
        "prefill": {"points": prefill_points, "fits": {k: f.to_dict() for k, f in fits.items()}, "use": use,
                    "chunk_buckets": [int(b) for b in chunk_buckets]},
        "decode": {"points": decode_points, "fit": fit_decode(decode_points).to_dict()},
    }
    costs_from_profile(profile)  # refuse to write a profile that cannot be read back
    return profile


def costs_from_profile(profile: dict | str) -> InstanceCosts:
    """The instance costs a profile describes (a parsed object or its JSON text); ValueError saying what is wrong."""
    if isinstance(profile, str):
        try:
            profile = json.loads(profile)
        except json.JSONDecodeError as e:
            raise ValueError(f"profile is not valid JSON: {e}") from None
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        raise ValueError(f"not a cost profile: expected an object with \"format\": \"{FORMAT}\"")
    try:
        prefill = profile["prefill"]
        return InstanceCosts(
            name=str(profile.get("name", "profile")),
            prefill=PrefillCost(prefill["fits"][prefill["use"]]["coef"], tuple(prefill.get("chunk_buckets", ()))),
            decode=DecodeCost(profile["decode"]["fit"]["coef"]),
            kv_bytes_per_token=float(profile["kv_bytes_per_token"]),
            nic_bytes_per_s=float(profile["nic_bytes_per_s"]),
            kv_capacity_tokens=int(profile["kv_capacity_tokens"]),
            cost_per_hour=float(profile.get("cost_per_hour", 0.0)),
            hardware=str(profile.get("hardware", "measured")),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"cost profile lacks or mistypes {e}") from None


def load_profile(path: str | Path) -> InstanceCosts:
    """Read a profile JSON file written by ``mooncake-jax profile``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no profile file at {path}")
    return costs_from_profile(path.read_text())


def fit_report(profile: dict) -> str:
    """A few lines saying how well each model fits its points."""
    def line(label: str, fit: dict) -> str:
        return (f"{label:<16} r2 {fit['r2']:.4f}  mean rel err {fit['mean_rel_err']:.1%}  "
                f"max rel err {fit['max_rel_err']:.1%}  ({fit['n_points']} points)")

    lines = [line(f"prefill {form}" + (" *" if form == profile["prefill"]["use"] else ""), fit)
             for form, fit in profile["prefill"]["fits"].items()]
    lines.append(line("decode step", profile["decode"]["fit"]))
    fast25 = profile["prefill"]["fits"].get("fast25")
    if fast25:
        lines.append(f"effective prefill FLOP/s (FAST'25 form): {fast25['params']['effective_flops_per_s']:.3g}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the command


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="engine preset name or Hugging Face folder (default tiny)")
    parser.add_argument("--out", "-o", help="profile JSON to write (default profile-<model>.json)")
    parser.add_argument("--prefill-tokens", type=_ints, default=[64, 128, 256, 512, 1024],
                        help="prompt lengths to time, comma-separated")
    parser.add_argument("--prefix-fractions", type=_floats, default=[0.0, 0.5, 0.75],
                        help="fractions of each prompt already cached, comma-separated")
    parser.add_argument("--decode-batches", type=_ints, default=[1, 2, 4, 8], help="decode batch sizes")
    parser.add_argument("--decode-context", type=_ints, default=[128, 512, 2048],
                        help="context tokens per sequence for the decode timings")
    parser.add_argument("--repeats", type=int, default=3, help="timings per point (the fastest is kept)")
    parser.add_argument("--layers", type=int, help="layers, for the FAST'25 fit (default: from the preset)")
    parser.add_argument("--d-model", type=int, help="hidden size, for the FAST'25 fit (default: from the preset)")
    parser.add_argument("--kv-bytes-per-token", type=float, help="default: from the preset")
    parser.add_argument("--nic-gbps", type=float, default=8.0,
                        help="bandwidth of the instance's KV transfers in Gbit/s (default 8: gRPC on loopback)")
    parser.add_argument("--kv-capacity-tokens", type=int, default=65536, help="KV tokens a decode instance holds")
    parser.add_argument("--cost-per-hour", type=float, default=0.0)
    parser.add_argument("--peak-gflops", type=float, help="peak FLOP/s of the device, to report the efficiency")
    parser.add_argument("--hardware", help="the kind of hardware measured, as the Conductor reports it "
                                           "(default: <devices>x<device kind> of the local JAX backend)")


def _model_shape(model: str) -> ModelShape | None:
    """The engine's own config for ``model`` when the engine is importable, else a built-in shape, else None."""
    try:
        from mooncake_jax.model.config import PRESETS, from_hf_config
    except ImportError:
        return MODEL_SHAPES.get(model)
    if model in PRESETS:
        return ModelShape.from_model_config(PRESETS[model])
    if Path(model).exists():
        return ModelShape.from_model_config(from_hf_config(model))
    return MODEL_SHAPES.get(model)


def local_hardware_kind() -> str:
    """``<n>x<device kind>`` of the local JAX backend (e.g. ``8xTPU v5 lite``, ``1xcpu``)."""
    try:
        import jax

        devices = jax.local_devices()
        return f"{len(devices)}x{devices[0].device_kind}"
    except Exception:  # noqa: BLE001  (no backend: still a valid profile)
        return "measured"


def measurement_grid(args) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(n_tokens, prefix_tokens) and (batch, context per sequence) points to time, duplicates removed."""
    prefill = sorted({(n, min(int(n * f), n - 1)) for n in args.prefill_tokens for f in args.prefix_fractions})
    decode = sorted({(b, c) for b in args.decode_batches for c in args.decode_context})
    return prefill, decode


def run(args) -> int:
    try:
        from mooncake_jax.model.measure import measure_decode_step, measure_prefill
    except ImportError as e:
        print(f"mooncake-jax profile: the engine's measurement functions (mooncake_jax.model.measure) are not "
              f"available, so there is nothing to time: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    shape = _model_shape(args.model)
    layers = args.layers or (shape and shape.layers)
    d_model = args.d_model or (shape and shape.d_model)
    kv_bytes = args.kv_bytes_per_token or (shape and shape.kv_bytes_per_token)
    if not kv_bytes:
        print(f"mooncake-jax profile: the shape of model {args.model!r} is unknown; pass --kv-bytes-per-token "
              f"(and --layers/--d-model for the FAST'25 fit)", file=sys.stderr)
        return 2
    if args.repeats < 1 or not args.prefill_tokens or not args.decode_batches:
        print("mooncake-jax profile: --repeats must be >= 1 and the grids non-empty", file=sys.stderr)
        return 2
    prefill_grid, decode_grid = measurement_grid(args)
    prefill_points, decode_points = [], []
    with tqdm(total=len(prefill_grid) + len(decode_grid), desc="profile", unit="point") as bar:
        for n, p in prefill_grid:
            seconds = min(measure_prefill(args.model, n, p) for _ in range(args.repeats))
            prefill_points.append((n, p, seconds))
            bar.update()
        for b, c in decode_grid:
            seconds = min(measure_decode_step(args.model, b, c) for _ in range(args.repeats))
            decode_points.append((b, b * c, seconds))
            bar.update()
    try:
        profile = build_profile(
            f"{args.model}@local", args.model, prefill_points, decode_points, kv_bytes_per_token=kv_bytes,
            nic_bytes_per_s=args.nic_gbps * 1e9 / 8, kv_capacity_tokens=args.kv_capacity_tokens,
            cost_per_hour=args.cost_per_hour, layers=layers, d_model=d_model,
            peak_flops_per_s=args.peak_gflops * 1e9 if args.peak_gflops else None,
            hardware=getattr(args, "hardware", None) or local_hardware_kind())
    except ValueError as e:
        print(f"mooncake-jax profile: cannot fit the measured points: {e}", file=sys.stderr)
        return 1
    out = Path(args.out or f"profile-{Path(args.model).name}.json")
    out.write_text(json.dumps(profile, indent=1))
    print(fit_report(profile))
    print(f"wrote {out}")
    return 0

