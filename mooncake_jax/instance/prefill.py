"""The prefill instance's service: run the Conductor's transfer plan, prefill reusing every cached block it can,
store the new KV in the pool, hand the request's KV to the decode instance, and answer with the first token.

Order of work for one request (engine work on the engine loop through its scheduler, all I/O on transfer threads):

1. transfer thread: fetch the planned blocks from the source instance's pool into this pool (Messenger; keys
   already here are not sent), pinned until the request is done; then read the prompt's leading blocks that the
   engine does not cache from the pool (DRAM / SSD) into host buffers;
2. engine loop: reuse the prompt's leading blocks from the engine's own page cache, load the staged ones into
   pages, prefill the rest, read the prompt's blocks the pool lacks out of the engine, release the sequence
   (layer-wise: ``LayerwisePrefill`` over the staged prefix, returning the new blocks);
3. transfer thread: write those blocks into the pool (which announces them to the Conductor as KV events) and push
   the request's blocks (full blocks and the partial tail) to the decode instance's pool;
4. report PREFILL_DONE to the Conductor and return the first token.

A fetch that fails is not fatal: the blocks are recomputed instead. The queue of predicted prefill seconds is what
the heartbeat reports as ``queued_s``, scaled by the instance's measured slowdown (``SlowdownMeter``: how much
longer than the cost model its recent requests took, the wait in the queue aside), which the heartbeat reports too
so the Conductor scales its predictions for this instance alike.

A request that can no longer meet the cluster's TTFT SLO here is refused with RESOURCE_EXHAUSTED (a 429 for its
client, within the SLO) instead of being prefilled into a late first token: on arrival, when its predicted wait and
work, both scaled by the measured slowdown, exceed what is left of its prefill's budget (the SLO less what follows
the prefill, ``accounting.prefill_budget_s``: the rule the Conductor admits by), and again when it leaves the
queue. The Conductor's prediction should make this rare; it is the check
of last resort for a burst that came before the slowdown was measured. Under admission ``none`` (the Conductor
says so at registration) nothing is refused.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import threading
import time

import numpy as np

from ..model.engine import Engine
from ..model.sequence import Sequence
from ..transfer.messenger import BlocksNotFoundError, TransferError
from ..blocks import BlockKey
from ..conductor.accounting import REAL_INSTANCES, after_prefill_s, prefill_budget_s, prefill_work_s
from ..conductor.costs import transfer_seconds
from ..transfer.offload import LayerwisePrefill, request_keys
from ..engine.runner_loop import wait
from ..proto import UNANSWERED
from . import compile_time
from .rpc import InstanceService, LateRejection, logprob_message, messages, rpc, sampling_params, validated

log = logging.getLogger(__name__)

FETCH_WAIT_S = 2.0


class SlowdownMeter:
    """Measured over predicted compute seconds of this instance's recent prefills: the median ratio, each request
    weighted by its predicted seconds, of those that ended within the last ``window_s`` (at most ``samples`` of
    them); 1 when there are none. The cost model was measured once, at start-up; on a host other work loads (or at
    a lower priority) the same prefill takes several times longer, and a Conductor predicting from the model alone
    admits requests that then miss the TTFT SLO. Compute only: fixed per-request costs (staging, pushing the KV)
    are no slowdown of the model, and counted in would make a 20-token prompt look 10x slow (measured: the demo
    refused 9 of 100 requests that then met their SLO). The weights let the long prompts that decide the SLO
    decide the scale; the median ignores a few outliers; the window lets an
    instance nobody sends work to any more (it looked slow) return to its model's figures. ``overhead`` is the
    median of the same requests' fixed costs; ``after_prefill`` the median of their part after the prefill (storing
    and pushing the KV), which the instance's own last-resort check leaves room for where it is longer than the
    predicted push (measured: without the fixed costs, 3% of admitted requests missed a 2 s SLO under overload; the
    part before the prefill, staging, has already elapsed when the check runs, and is no longer counted twice).

    The caller records compute less the seconds it spent compiling programs on first use (``compile_time.py``):
    those are no slowdown of the model, and a few of them are no outliers the median ignores. The first request of
    each layer-wise bfloat16 prefill instance of ``demo --hetero`` compiled its programs (nothing had), and was the
    meter's only sample: 8.5x and 27x; the Conductor scaled every prediction by that and refused all 20 requests of
    the replay (docs/benchmarks/demo.md, hetero ninth pass).

    What it reads is the served slowdown, not a bias of the model, as long as the model was measured on the path
    served at the lengths served (``calibrate.py``). Measured (tiny, the demo's 100 prompts, Intel Xeon (207) 2
    cores, docs/benchmarks/demo.md eleventh pass): with a calibration of prompts up to 512 tokens without the read-out
    of the new blocks, one prefill process alone at niceness 0 read 2.0 (long prompts 2-2.6x their model); with the
    calibration of the served path up to 2,048 new tokens, 1.65 (1.03-1.21x up to 1,024 new tokens). At niceness 5
    beside a busy decode and a second prefill process (what the demo's prefill instances serve in) short prompts run
    4-5x their model and long ones 2.5-4x: that part is real, and the Conductor's scaled predictions should carry it."""

    def __init__(self, window_s: float = 30.0, samples: int = 32, clock=time.monotonic):
        self.window_s, self._clock = window_s, clock
        self._ratios: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=samples)
        self._overheads: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=samples)
        self._lock = threading.Lock()

    def record(self, measured_s: float, predicted_s: float, overhead_s: float | None = None,
               after_s: float | None = None) -> None:
        """``overhead_s``: the request's fixed costs (staging its prefix, storing and pushing its KV); ``after_s``:
        the part of them after its prefill (storing and pushing), which the late check's budget leaves room for."""
        with self._lock:
            if predicted_s > 0 and measured_s >= 0:
                self._ratios.append((self._clock(), min(100.0, max(0.01, measured_s / predicted_s)), predicted_s))
            if overhead_s is not None and overhead_s >= 0:
                self._overheads.append((self._clock(), overhead_s, overhead_s if after_s is None else after_s))

    def _recent(self, samples: collections.deque) -> list[list[float]]:
        """``samples`` (each ``(at, *values)``) taken within the window, without their times."""
        since = self._clock() - self.window_s
        with self._lock:
            return [values for at, *values in samples if at >= since]

    def overhead(self) -> float:
        recent = [seconds for seconds, _ in self._recent(self._overheads)]
        return float(np.median(recent)) if recent else 0.0

    def after_prefill(self) -> float:
        """Median seconds of the recent requests' work after their prefill (storing and pushing the KV)."""
        recent = [after for _, after in self._recent(self._overheads)]
        return float(np.median(recent)) if recent else 0.0

    def slowdown(self) -> float:
        recent = sorted(self._recent(self._ratios))  # (ratio, weight), by ratio
        if not recent:
            return 1.0
        half, total = 0.5 * sum(w for _, w in recent), 0.0
        for i, (ratio, weight) in enumerate(recent):
            total += weight
            if math.isclose(total, half, rel_tol=1e-9) and i + 1 < len(recent):
                return 0.5 * (ratio + recent[i + 1][0])  # the weight splits evenly between two ratios
            if total > half:
                return ratio
        return recent[-1][0]


class PrefillService(InstanceService):
    def __init__(self, instance):
        super().__init__(instance, ("prefill_requests", "prefill_prompt_tokens", "prefill_cached_tokens",
                                    "prefill_fetched_blocks", "prefill_pushed_blocks", "prefill_fetch_failures",
                                    "prefill_refused_ttft"))
        self._queued_s = 0.0
        # request -> prompt tokens: counted in ``_queued_s`` (or computed) and not yet reported done; the heartbeat
        # names them, so the Conductor adds back the requests it sent here that have not arrived (``load``)
        self._held: dict[str, int] = {}
        self.slowdown = SlowdownMeter()
        compile_time.clock()  # listening from now on: the meter is fed compute less compile time
        self._peer_same_spec: dict[str, bool] = {}
        self._layerwise = _layerwise(instance.engine) if instance.config.layerwise else None

    def load(self) -> dict:
        """The heartbeat's load: the queue (predicted seconds scaled by the measured slowdown), the slowdown, and
        the requests that queue counts (``active``, with those computed and not yet reported done): the Conductor
        adds its own predictions for the requests it sent here that are not among them yet (the Prefill RPC,
        fetching and staging their prefix), which a heartbeat in the middle of a burst would otherwise drop from
        this instance's queue (``conductor/state.py``)."""
        slowdown = self.slowdown.slowdown()
        with self._lock:
            return {"queued_s": self._queued_s * slowdown, "prefill_slowdown": slowdown,
                    "active": dict(self._held)}

    def stats(self) -> dict[str, float]:
        with self._lock:
            queued = self._queued_s
        return self.counts() | {"prefill_queued_s": queued, "prefill_slowdown": self.slowdown.slowdown()}

    @rpc
    def Prefill(self, request, context):
        t0 = time.perf_counter()
        inst, engine = self.instance, self.instance.engine
        seq = validated(lambda: engine.new_sequence(list(request.prompt), sampling_params(request.sampling)))
        keys = request_keys(seq, engine.block_size)
        try:
            if inst.link is not None:
                inst.link.ignored_keys.update(keys[len(seq.prompt) // engine.block_size:])  # the tail is private
            with inst.pool.pin(list(request.fetch_keys) + keys):
                timeout = inst.config.request_timeout_s
                fetch_failed = bool(request.fetch_from and request.fetch_keys and wait(
                    inst.transfers.submit(self._fetch, request.fetch_from, list(request.fetch_keys)), timeout))
                staged = wait(inst.transfers.submit(self._stage_prefix, seq, keys), timeout)
                t_fetched = time.perf_counter()
                cached = (staged[0] + len(staged[1])) * engine.block_size  # engine cache + staged pool blocks
                predicted = prefill_work_s(inst.costs.prefill, len(seq.prompt), cached) if inst.costs else 0.0
                with self._lock:
                    queued = self._queued_s
                self._check_deadline(t0, queued + predicted, "on arrival, after the queue", len(seq.prompt))
                with self._lock:
                    self._queued_s += predicted
                    if request.request_id:
                        self._held[request.request_id] = len(seq.prompt)
                try:
                    queued_at = time.perf_counter()
                    started = {}
                    check = functools.partial(self._check_deadline, t0, predicted, "out of the queue",
                                              len(seq.prompt))
                    future = inst.loop.submit(lambda eng: self._prefill_job(eng, seq, keys, staged, started, check))
                    try:
                        new_keys, new_blocks = wait(future, timeout)
                    except TimeoutError:
                        future.cancel()
                        raise
                finally:
                    with self._lock:
                        self._queued_s = max(0.0, self._queued_s - predicted)
                t_prefilled = time.perf_counter()
                wait(inst.transfers.submit(self._store_and_push, new_keys, new_blocks, keys, request.push_to), timeout)
            self._count(prefill_requests=1, prefill_prompt_tokens=len(seq.prompt),
                        prefill_cached_tokens=seq.cached_tokens)
            if inst.link is not None:
                inst.link.report(request.request_id, "PREFILL_DONE")
        finally:
            with self._lock:
                self._held.pop(request.request_id, None)
        t_end = time.perf_counter()
        # its compute against what the cost model predicted for it, less any program compiled on first use (no
        # slowdown of the model: counted in, one first request read as a host 8-27x slower and the Conductor refused
        # every request for the meter's window); the rest of its own time (staging, pushing the KV) apart, as a
        # fixed cost
        compute = t_prefilled - started.get("t", queued_at) - started.get("compile_s", 0.0)
        self.slowdown.record(max(0.0, compute), predicted, overhead_s=(t_fetched - t0) + (t_end - t_prefilled),
                             after_s=t_end - t_prefilled)
        return messages.PrefillReply(
            first_token=seq.output[0], cached_tokens=seq.cached_tokens, kv_keys=keys,
            queue_s=started.get("t", queued_at) - queued_at, prefill_s=t_prefilled - started.get("t", queued_at),
            transfer_s=(t_fetched - t0) + (t_end - t_prefilled), finished=seq.finished,
            first_logprob=logprob_message(seq.logprobs[0] if seq.logprobs else None),
            prompt_logprobs=[logprob_message(entry) for entry in seq.prompt_logprobs or ()],
            kv_layout=inst.kv_layout.to_json(), fetch_failed=fetch_failed)

    def _check_deadline(self, t0: float, predicted_s: float, where: str, n_tokens: int = 0) -> None:
        """LateRejection when ``predicted_s`` of this instance's work (cost model seconds, scaled by the measured
        slowdown) no longer fits in what is left of the prefill's TTFT budget for a request of ``n_tokens`` that
        arrived at ``t0``: the one rule (``accounting.prefill_budget_s``) the Conductor admitted it by, what follows
        the prefill being the push of its KV over this instance's NIC (``after_push_s``), or the measured time of
        the recent requests' storing and pushing where that is longer. The time the request has spent here
        (staging its prefix, waiting) is gone from what is left; it is not counted again in its work."""
        slo = self.instance.ttft_slo_s
        if slo is None or predicted_s <= 0:
            return
        need = predicted_s * self.slowdown.slowdown()
        after = after_prefill_s(REAL_INSTANCES, max(self.after_push_s(n_tokens), self.slowdown.after_prefill()))
        left = t0 + prefill_budget_s(slo, after) - time.perf_counter()
        if need > left:
            self._count(prefill_refused_ttft=1)
            raise LateRejection(f"prefill instance {self.instance.config.instance_id} cannot meet the TTFT SLO of "
                                f"{slo:g} s ({where}: {need:.2f} s of work, {max(0.0, left):.2f} s left of "
                                f"{slo - after:.2f} s before the KV push)")

    def after_push_s(self, n_tokens: int) -> float:
        """Predicted seconds to push ``n_tokens`` of KV over this instance's NIC (the one transfer-time formula,
        ``costs.transfer_seconds``, as the Conductor predicts it for the pair); 0 without a cost model."""
        costs = self.instance.costs
        if costs is None or n_tokens <= 0:
            return 0.0
        return float(transfer_seconds(n_tokens * costs.kv_bytes_per_token, costs.nic_bytes_per_s))

    def _fetch(self, source: str, keys: list[int]) -> bool:
        """Run the transfer plan. The Conductor may plan blocks the source is still computing (another request's
        prefill there): the leading blocks it has are fetched at once, the rest retried for a short while, and
        whatever did not arrive is recomputed. Returns whether the source did not answer (``UNANSWERED``):
        the reply says so (``fetch_failed``), for the gateway to have a dead source dropped from the Conductor,
        which would otherwise keep planning fetches from it until its heartbeats are missed."""
        deadline = time.monotonic() + FETCH_WAIT_S
        messenger = self.instance.messenger(source)
        while keys:
            try:
                self._count(prefill_fetched_blocks=len(messenger.fetch(keys).moved))
                return False
            except BlocksNotFoundError as e:
                missing = set(e.keys)
                lead = list(itertools.takewhile(lambda k: k not in missing, keys))
                keys = keys[len(lead):]
                try:
                    if lead:
                        self._count(prefill_fetched_blocks=len(messenger.fetch(lead).moved))
                except TransferError:
                    keys = []
                if time.monotonic() > deadline:
                    self._count(prefill_fetch_failures=1)
                    return False
                time.sleep(0.02)
            except TransferError as e:
                log.warning("fetch from %s failed: %s", source, e)
                self._count(prefill_fetch_failures=1)
                return e.code in UNANSWERED
        return False

    def _stage_prefix(self, seq: Sequence, keys: list[BlockKey]) -> tuple[int, list[BlockKey], np.ndarray | None]:
        """On a transfer thread: the prompt's leading reusable blocks from the pool, after those the engine caches
        (layer-wise: from the first block, it does not use the engine's cache). Returns (index of the first staged
        block, their keys, their blocks [n, layers, 2, block_size, kv_heads, head_dim] or None)."""
        engine, pool = self.instance.engine, self.instance.pool
        if seq.params.prompt_logprobs is not None:  # every prompt position is computed: nothing to stage
            return 0, [], None
        usable = keys[: (len(seq.prompt) - 1) // engine.block_size]
        start = 0 if self._layerwise is not None else len(engine.kv.cached_pages(usable))
        n = pool.prefix_len(usable[start:])
        if not n:
            return start, [], None
        blocks = pool.get_many(usable[start: start + n])
        good = next((i for i, b in enumerate(blocks) if b is None), n)  # lost to damage since the lookup
        if not good:
            return start, [], None
        return start, usable[start: start + good], np.stack(blocks[:good])

    def _prefill_job(self, engine: Engine, seq: Sequence, keys: list[BlockKey], staged, started: dict,
                     check=None) -> tuple[list[BlockKey], np.ndarray | None]:
        """On the engine loop: prefill ``seq`` over its cached and staged prefix (after ``check()``, which may
        refuse it); returns the keys of the prompt's blocks the pool lacks and those blocks (host), for a transfer
        thread to store."""
        started["t"], since = time.perf_counter(), time.time()
        if check is not None:
            check()
        pool = self.instance.pool
        start, staged_keys, staged_blocks = staged
        try:
            if self._layerwise is not None and seq.params.prompt_logprobs is None:
                _, new_blocks = self._layerwise.prefill(seq, staged_blocks)
                return keys[len(staged_keys):], new_blocks
            pages = engine.cached_pages(keys[:start])
            if len(pages) == start and staged_keys:  # else the engine evicted part of its prefix meanwhile
                pages += engine.load_blocks(staged_keys, staged_blocks, protect=pages)
            engine.admit(seq, cached_pages=pages)
            engine.prefill(seq)
            new = [i for i, key in enumerate(keys) if key not in pool]  # an index lookup, no I/O
            if not new:
                return [], None
            return [keys[i] for i in new], engine.read_blocks([seq.pages[i] for i in new])
        finally:
            engine.release(seq)
            started["compile_s"] = compile_time.clock().seconds(since)  # this thread's (the engine loop's), this job

    def _store_and_push(self, new_keys: list[BlockKey], new_blocks, keys: list[BlockKey], push_to: str) -> None:
        """On a transfer thread: the new blocks into the pool, then the request's blocks to the decode instance."""
        if new_keys:
            self.instance.pool.put_many(new_keys, new_blocks[: len(new_keys)])
        if push_to and self._holds_our_blocks(push_to):
            moved = self.instance.messenger(push_to).push(keys).moved
            self._count(prefill_pushed_blocks=len(moved))

    def _holds_our_blocks(self, address: str) -> bool:
        """Whether the decode instance at ``address`` stores blocks of this instance's layout (asked once per
        peer). One that does not (another page size, dtype or model split) fetches the request's blocks from this
        pool in this layout and converts them itself, so nothing is pushed to it."""
        with self._lock:
            known = self._peer_same_spec.get(address)
        if known is None:
            known = self.instance.messenger(address).same_spec()
            with self._lock:
                self._peer_same_spec[address] = known
        return known


def _layerwise(engine: Engine) -> LayerwisePrefill:
    """The layer-wise prefill of ``engine``: ``prefill(seq, prefix_blocks) -> (logits, new_blocks)``, no pool I/O."""
    return LayerwisePrefill(engine)
