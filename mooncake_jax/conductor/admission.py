"""Admission: which decode load a request is checked against, when it is rejected, and the decode side's check.

The four policies differ only in *what decode load the checks see* and *where they happen*. Two checks judge
decode load, each on every decode instance: capacity (the request's KV must fit beside the load, and a batch slot
must be free where the instance registered its ``max_batch``) and TBT (the step time with the request added must
stay within the SLO). A request is rejected on decode load only when no decode instance passes both.

- ``none``: no check.
- ``baseline``: TTFT checked here; KV capacity and TBT checked by the decode instance when the KV arrives
  (``decode_accepts``), so a rejection there wastes the prefill (a *late* rejection).
- ``early``: TTFT, KV capacity and TBT checked here, under the decode load *now*: the requests decoding at this
  moment. Rejecting on current load makes the two pools oscillate in anti-phase: a loaded decode pool turns
  away requests whose KV would only have arrived after the load drained, and a light one accepts requests that
  will meet the prefills still in flight.
- ``predictive``: the same checks under the load predicted for the moment this request's prefill ends:
  requests whose prefill ends before then are added, requests that will have spent the uniform decode time t_d
  by then are removed (``DecodeLedger.at``; a request observed decoding past t_d stays until it is reported
  finished). t_d is each decode instance's own (the moving average of its requests' reported decode times): a
  faster decode instance, or a lighter one, turns its requests over sooner.
"""

from __future__ import annotations

from mooncake_jax.conductor.accounting import prefill_budget_s
from mooncake_jax.conductor.api import Admission, PolicyConfig, RejectReason
from mooncake_jax.conductor.costs import DecodeCost

CHECKS_DECODE_HERE = (Admission.EARLY, Admission.PREDICTIVE)
"""Policies that reject on decode load (TBT, KV capacity) before prefill rather than leaving it to the decode side."""


def rejection(config: PolicyConfig, ttft_s: float, tbt_s: float, after_s: float = 0.0) -> RejectReason | None:
    """The reason to reject now, if any, given the predicted TTFT up to the prefill's end (queue, fetch, compute),
    what of the TTFT follows it (``after_s``: ``accounting.after_prefill_s``) and the (admission-view) TBT. The
    TTFT check is the one budget rule (``accounting.prefill_budget_s``) the prefill instances check too."""
    if config.admission == Admission.NONE:
        return None
    if ttft_s > prefill_budget_s(config.ttft_slo_s, after_s):
        return RejectReason.TTFT_SLO
    if config.admission in CHECKS_DECODE_HERE and tbt_s > config.tbt_slo_s:
        return RejectReason.TBT_SLO
    return None


def decode_accepts(cost: DecodeCost, batch: int, context_tokens: int, kv_tokens: int, tbt_slo_s: float,
                   kv_capacity_tokens: int | None = None) -> bool:
    """The decode instance's own check when a request's KV arrives (late rejection when False).

    ``batch``/``context_tokens`` are its running batch; the request adds one sequence of ``kv_tokens``.
    Decode instances and the simulator call this, so the rule is written once.
    """
    if kv_capacity_tokens is not None and context_tokens + kv_tokens > kv_capacity_tokens:
        return False
    return cost.step_seconds(batch + 1, context_tokens + kv_tokens) <= tbt_slo_s
