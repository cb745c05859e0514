"""One accounting of a prefill instance's time, shared by the Conductor, the real instances and the simulator.

The Conductor predicts TTFT from an instance's queue and cost model; the instance reports its queue in heartbeats;
the simulator times the same work. If the three count differently (a cached prefix counted on one side and not
the other, the KV push before or after the first token), the simulator cannot predict the real cluster and the
Conductor's predictions drift from what the instances report. So the rules live here, once:

- **Work of a prefill**: ``prefill_work_s(cost, n_tokens, cached_tokens)``: the prompt's leading cached tokens
  (engine page cache, pool, fetched blocks) are not computed, but the last prompt token always is (it yields the
  first output token), so at most ``n_tokens - 1`` are reused; the new tokens count as the engine computes them,
  each chunk padded to the length its program was compiled for (``PrefillCost.chunk_buckets``: a 300-token
  prompt costs what 512 tokens cost on an engine with 16/64/256/512-token buckets).
- **Queue**: the predicted work of every request accepted by the instance and not yet finished, the running one
  included at its full prediction (``queued_s``; the Conductor drains it at ``now + queued_s``). An instance counts
  a request once it holds it; a request the Conductor has sent it and that has not arrived (the decision's reply,
  the Prefill RPC, fetching and staging its prefix: tens of milliseconds in a burst on a loaded host) is counted by
  the Conductor, at its decision's prediction: a heartbeat names the requests its instance holds (``active``) and
  ``ClusterState.heartbeat`` adds the others back. A heartbeat that replaced the queue with the instance's own
  figure in the middle of a burst made the burst's next requests look free to go there.
- **KV push and first-token release** (``ReleaseTiming``): the KV goes to the decode instance after the prefill
  (``after-prefill``, one push of the request's blocks) or streams layer by layer during it (``layerwise``); the
  first token is released when the prefill ends (``at-prefill-end``) or once the KV has reached the decode
  instance (``after-push``). The real instances push after the prefill and answer after the push
  (``REAL_INSTANCES``); the simulator's default is the paper's layer-wise streaming (``LAYERWISE``).
- **TTFT budget of a prefill** (``prefill_budget_s``): the TTFT SLO less what of the TTFT follows the prefill's end
  (``after_prefill_s``: the KV push where the first token waits for it, and the time off the engine the first
  token's release takes where it is measured). The queue, the planned fetch and the compute must fit in it. The
  Conductor's admission (``admission.rejection``, through ``Policy``), the simulator's (the same ``Policy``, given
  the simulator's release timing) and the prefill instance's late check (``instance/prefill.py``) all check
  against it. The push is the one transfer-time formula (``costs.transfer_seconds``) over the pair's link: the
  Conductor knows the pair, the instance its own NIC (the pair's link is the slower NIC of the two or a measured
  figure, so on alike instances both predict the same push). A flat share (10% of the SLO, kept by the instance
  while the Conductor admitted on the whole SLO) made the two disagree on every request predicted within 10% of
  the SLO: admitted, then refused on arrival ("1.80 s of work, 1.79 s left" at an SLO of 2 s).
"""

from __future__ import annotations

import dataclasses

KV_PUSH = ("after-prefill", "layerwise")
FIRST_TOKEN = ("at-prefill-end", "after-push")


def reused_tokens(n_tokens: int, cached_tokens: int) -> int:
    """Cached leading tokens a prefill of ``n_tokens`` skips: all but the last prompt token at most."""
    return max(0, min(int(cached_tokens), int(n_tokens) - 1))


def prefill_work_s(prefill_cost, n_tokens: int, cached_tokens: int) -> float:
    """Predicted seconds of one prefill (``prefill_cost``: a ``PrefillCost``) over its cached prefix, counting
    the new tokens as the engine computes them (each chunk padded to its compiled length, ``chunk_buckets``)."""
    reused = reused_tokens(n_tokens, cached_tokens)
    computed = prefill_cost.computed_tokens(int(n_tokens) - reused)
    return float(prefill_cost.seconds(reused + computed, reused))


@dataclasses.dataclass(frozen=True)
class ReleaseTiming:
    """When a prefilled request's KV moves to its decode instance and when its first token is released."""

    kv_push: str = "layerwise"
    first_token: str = "at-prefill-end"

    def __post_init__(self):
        if self.kv_push not in KV_PUSH:
            raise ValueError(f"unknown kv_push {self.kv_push!r}; choose from {list(KV_PUSH)}")
        if self.first_token not in FIRST_TOKEN:
            raise ValueError(f"unknown first_token {self.first_token!r}; choose from {list(FIRST_TOKEN)}")

    def push_start(self, prefill_start: float, prefill_end: float) -> float:
        """When the push of the request's KV may start."""
        return prefill_start if self.kv_push == "layerwise" else prefill_end

    def first_token_at(self, prefill_end: float, kv_ready_at: float) -> float:
        """When the client gets the first token, given when the prefill ends and when the KV is on decode."""
        return prefill_end if self.first_token == "at-prefill-end" else max(prefill_end, kv_ready_at)


def after_prefill_s(timing: ReleaseTiming, push_s: float, prefill_s: float = 0.0,
                    off_engine_s: float = 0.0) -> float:
    """Seconds of a request's TTFT that follow its prefill's end, under ``timing``: ``off_engine_s`` (the
    measured path of the first token off the engine: storing, the reply; 0 where nothing is measured) and, where
    the first token waits for the KV (``after-push``), the push of ``push_s`` seconds: all of it when pushed after
    the prefill, what outlasts a prefill of ``prefill_s`` seconds when streamed layer by layer during it."""
    if not (push_s >= 0 and prefill_s >= 0 and off_engine_s >= 0):
        raise ValueError(f"push_s, prefill_s and off_engine_s must be non-negative seconds, got {push_s!r}, "
                         f"{prefill_s!r}, {off_engine_s!r}")
    if timing.first_token == "at-prefill-end":
        push = 0.0
    elif timing.kv_push == "layerwise":
        push = max(0.0, push_s - prefill_s)
    else:
        push = push_s
    return float(off_engine_s) + float(push)


def prefill_budget_s(ttft_slo_s: float, after_s: float) -> float:
    """Seconds a request's queue, planned fetch and prefill may take, counted from its decision, to meet the TTFT
    SLO: the SLO less what follows the prefill (``after_prefill_s``). Negative when even an idle instance cannot
    (the push alone outlasts the SLO)."""
    return float(ttft_slo_s) - float(after_s)


LAYERWISE = ReleaseTiming("layerwise", "at-prefill-end")
"""The paper's design: KV streamed during the prefill, first token at once."""
REAL_INSTANCES = ReleaseTiming("after-prefill", "after-push")
"""What ``mooncake_jax/instance/prefill.py`` does: store and push after the prefill, then answer."""
