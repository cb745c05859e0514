"""The prefill instance's service: run the Conductor's transfer plan, prefill reusing every cached block it can,
store the new KV in the pool, hand the request's KV to the decode instance, and answer with the first token.

Order of work for one request (the engine part runs on the engine loop, FIFO, everything else on the gRPC thread):

1. fetch the planned blocks from the source instance's pool into this pool (Messenger; keys already here are not
   sent), pinned until the prefill has read them;
2. on the engine loop: reuse the prompt's leading blocks from the engine's own page cache, then from the pool
   (loaded into pages), prefill the rest, write every new block of the prompt into the pool (the pool announces
   them to the Conductor as KV events), release the sequence;
3. push the request's blocks (full blocks and the partial tail) to the decode instance's pool;
4. report PREFILL_DONE to the Conductor and return the first token.

A fetch that fails is not fatal: the blocks are recomputed instead. The queue of predicted prefill seconds is what
the heartbeat reports as ``queued_s``.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from ..model.engine import Engine
from ..model.sequence import Sequence
from ..transfer.messenger import BlocksNotFoundError, TransferError
from ..transfer.offload import LayerwisePrefill, pool_prefix, request_keys
from .engine_loop import wait
from .rpc import InstanceService, messages, rpc, sampling_params, validated

log = logging.getLogger(__name__)

FETCH_WAIT_S = 2.0


class PrefillService(InstanceService):
    def __init__(self, instance):
        super().__init__(instance, ("prefill_requests", "prefill_prompt_tokens", "prefill_cached_tokens",
                                    "prefill_fetched_blocks", "prefill_pushed_blocks", "prefill_fetch_failures"))
        self._queued_s = 0.0
        self._layerwise = LayerwisePrefill(instance.engine) if instance.config.layerwise else None

    def load(self) -> dict:
        with self._lock:
            return {"queued_s": self._queued_s}

    def stats(self) -> dict[str, float]:
        with self._lock:
            queued = self._queued_s
        return self.counts() | {"prefill_queued_s": queued}

    @rpc
    def Prefill(self, request, context):
        t0 = time.perf_counter()
        inst, engine = self.instance, self.instance.engine
        seq = validated(lambda: engine.new_sequence(list(request.prompt), sampling_params(request.sampling)))
        keys = request_keys(seq, engine.block_size)
        if inst.link is not None:
            inst.link.ignored_keys.update(keys[len(seq.prompt) // engine.block_size:])  # the tail is private
        with inst.pool.pin(list(request.fetch_keys) + keys):
            if request.fetch_from and request.fetch_keys:
                self._fetch(request.fetch_from, list(request.fetch_keys))
            t_fetched = time.perf_counter()
            predicted = inst.costs.prefill.seconds(len(seq.prompt), 0) if inst.costs else 0.0
            with self._lock:
                self._queued_s += predicted
            try:
                queued_at = time.perf_counter()
                started = {}
                future = inst.loop.submit(lambda eng: self._prefill_job(eng, seq, keys, started))
                wait(future, inst.config.request_timeout_s)
            finally:
                with self._lock:
                    self._queued_s = max(0.0, self._queued_s - predicted)
            t_prefilled = time.perf_counter()
            if request.push_to:
                moved = inst.messenger(request.push_to).push(keys).moved
                self._count(prefill_pushed_blocks=len(moved))
        self._count(prefill_requests=1, prefill_prompt_tokens=len(seq.prompt),
                    prefill_cached_tokens=seq.cached_tokens)
        if inst.link is not None:
            inst.link.report(request.request_id, "PREFILL_DONE")
        t_end = time.perf_counter()
        return messages.PrefillReply(
            first_token=seq.output[0], cached_tokens=seq.cached_tokens, kv_keys=keys,
            queue_s=started.get("t", queued_at) - queued_at, prefill_s=t_prefilled - started.get("t", queued_at),
            transfer_s=(t_fetched - t0) + (t_end - t_prefilled), finished=seq.finished)

    def _fetch(self, source: str, keys: list[int]) -> None:
        """Run the transfer plan. The Conductor may plan blocks the source is still computing (another request's
        prefill there): the leading blocks it has are fetched at once, the rest retried for a short while, and
        whatever did not arrive is recomputed."""
        deadline = time.monotonic() + FETCH_WAIT_S
        messenger = self.instance.messenger(source)
        while keys:
            try:
                self._count(prefill_fetched_blocks=len(messenger.fetch(keys).moved))
                return
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
                    return
                time.sleep(0.02)
            except TransferError as e:
                log.warning("fetch from %s failed: %s", source, e)
                self._count(prefill_fetch_failures=1)
                return

    def _prefill_job(self, engine: Engine, seq: Sequence, keys: list[int], started: dict) -> None:
        """On the engine loop: prefill ``seq`` over every reusable block and store its new blocks in the pool."""
        started["t"] = time.perf_counter()
        pool = self.instance.pool
        if self._layerwise is not None:
            prefix = pool_prefix(pool, seq, engine.block_size)
            n = 0 if prefix is None else len(prefix)
            _, new_blocks = self._layerwise.prefill(seq, prefix)
            pool.put_many(keys[n:], new_blocks)
        else:
            usable = keys[: (len(seq.prompt) - 1) // engine.block_size]
            pages = engine.cached_pages(usable)
            from_pool = []
            for key in usable[len(pages):]:
                if key not in pool:
                    break
                from_pool.append(key)
            if from_pool:
                blocks = pool.get_many(from_pool)
                good = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
                if good:
                    pages += engine.load_blocks(from_pool[:good], np.stack(blocks[:good]), protect=pages)
            engine.admit(seq, cached_pages=pages)
            engine.prefill(seq)
            new = [i for i, key in enumerate(keys) if key not in pool]
            if new:
                pool.put_many([keys[i] for i in new], engine.read_blocks([seq.pages[i] for i in new]))
        engine.release(seq)
