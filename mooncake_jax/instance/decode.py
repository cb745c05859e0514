"""The decode instance's service: take a prefilled request whose KV has arrived, re-check the TBT SLO, and stream its
tokens from the continuous batch.

``Decode`` first sends ``accepted`` (or fails with RESOURCE_EXHAUSTED: a *late* rejection, the prefill work wasted)
and then one message per generated token (with a gateway's token feed, which brings each token on its own: the tokens
in batches, ``FEED_BATCH_INTERVAL_S`` apart). On arrival:

1. on a transfer thread (never the engine's): the request's blocks that the engine does not cache are read from
   this instance's pool (DRAM / SSD) into host buffers; blocks evicted from the pool since the prefill instance
   pushed them are fetched again from it (``kv_source``, Messenger) first;
2. on the engine loop, through the scheduler (a batch slot or a refusal, never a wait): the predicted step time
   with this request added must stay within the TBT SLO (``conductor.admission.decode_accepts``, the rule the
   simulator applies too) and the KV must fit; the staged blocks are loaded into pages and the sequence joins the
   batch. Cached blocks evicted while the others were staged are staged in turn and the admission retried.

So a running batch keeps stepping while a request's KV is read or fetched. A client that goes away cancels the
stream; the sequence is dropped and its pages freed before the next step.
"""

from __future__ import annotations

import functools
import logging

import grpc

import numpy as np

from ..conductor.admission import decode_accepts
from ..kv_layout import KVLayout, exchange_problem
from ..transfer.offload import request_keys
from ..transfer.relayout import convert
from ..transfer.spec import BlockSpec
from ..model.engine import Engine
from ..model.kv_cache import OutOfPages
from ..model.sequence import Sequence
from ..engine.runner_loop import TokenStream, wait
from ..engine.scheduler import BatchFull, QueueFull
from ..gateway.token_feed import FeedSender
from .rpc import (InstanceService, LateRejection, MissingKV, logprob_entry, logprob_message, messages,
                  sampling_params, status_of, validated)

log = logging.getLogger(__name__)


FEED_BATCH_INTERVAL_S = 0.05
"""With a token feed, how often a Decode stream sends the tokens generated since its last message: the feed brings
each one to the gateway at once, so the stream is only its fallback (a datagram lost, or an address the instance
cannot reach); one message per token would cost a wake-up of this process's gRPC threads and of the gateway's
stream reader for each, the waits the feed exists to avoid."""


def _feed(request, seq: Sequence) -> FeedSender | None:
    """Where this request's tokens go as they are generated (``gateway/token_feed.py``), if anywhere: not for
    requests with logprobs (the stream carries those), and not to an address that cannot be read (the stream
    brings every token anyway)."""
    if not request.token_feed or seq.params.logprobs is not None:
        return None
    try:
        return FeedSender(request.token_feed, request.request_id)
    except ValueError as e:  # a client's own request id may hold spaces or other than ASCII
        log.debug("request %s: token feed %r not used: %s", request.request_id, request.token_feed, e)
        return None


class DecodeService(InstanceService):
    def __init__(self, instance):
        super().__init__(instance, ("decode_requests", "decode_rejected_late", "decode_tokens", "decode_aborted"))
        self._active: dict[str, Sequence] = {}

    def load(self) -> dict:
        with self._lock:
            return {"active": {rid: seq.num_tokens for rid, seq in self._active.items()}}

    def stats(self) -> dict[str, float]:
        with self._lock:
            active = len(self._active)
        sched = self.instance.loop.scheduler  # read without its lock: three counters, each consistent enough
        return self.counts() | {"decode_active": float(active), "decode_steps_total": float(sched.steps),
                                "decode_step_seconds_total": sched.step_seconds,
                                "decode_step_rows_total": float(sched.step_rows)}

    def Decode(self, request, context):
        inst = self.instance
        try:
            seq, source_layout = validated(lambda: self._parse(request))
            stream = TokenStream(timeout_s=inst.config.request_timeout_s, feed=_feed(request, seq))
            self._start(seq, request, stream, source_layout)
        except Exception as e:
            code = status_of(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("Decode %s failed", request.request_id)
            if isinstance(e, (LateRejection, QueueFull)):
                self._count(decode_rejected_late=1)
                if inst.link is not None:
                    inst.link.report(request.request_id, "DROPPED")
            context.abort(code, str(e))
        self._count(decode_requests=1)
        with self._lock:
            self._active[request.request_id] = seq
        if inst.link is not None:
            inst.link.report(request.request_id, "DECODE_STARTED")
        context.add_callback(lambda: inst.loop.cancel(seq) if not seq.finished else None)
        try:
            yield messages.DecodeEvent(accepted=messages.DecodeEvent.Accepted())
            if stream.feeds:  # each token went to the gateway's feed as it was put: here only in batches
                for index, tokens in stream.batches(FEED_BATCH_INTERVAL_S):
                    self._count(decode_tokens=len(tokens))
                    yield messages.DecodeEvent(tokens=messages.DecodeEvent.Tokens(index=index, tokens=tokens))
            else:
                for index, token in enumerate(stream, start=1):
                    self._count(decode_tokens=1)
                    logprob = logprob_message(seq.logprobs[index]) if seq.params.logprobs is not None else None
                    yield messages.DecodeEvent(token=messages.DecodeEvent.Token(token=token, index=index,
                                                                                logprob=logprob))
            if stream.finish_reason == "abort":
                self._count(decode_aborted=1)
            yield messages.DecodeEvent(done=messages.DecodeEvent.Done(reason=stream.finish_reason or "abort"))
        finally:
            if not seq.finished:
                inst.loop.cancel(seq)
            with self._lock:
                self._active.pop(request.request_id, None)
            if inst.link is not None:  # an aborted request's duration would mislead the Conductor's t_d
                inst.link.report(request.request_id,
                                 "FINISHED" if seq.finish_reason in ("length", "stop") else "DROPPED")

    def _parse(self, request) -> tuple[Sequence, KVLayout | None]:
        """The request's sequence, and the layout of its KV blocks when they are not this instance's own (a
        prefill instance of another page size, dtype, tensor parallelism or stages: converted on arrival)."""
        engine = self.instance.engine
        seq = engine.new_sequence(list(request.prompt), sampling_params(request.sampling))
        if not 0 <= request.first_token < engine.cfg.vocab_size:
            raise ValueError(f"first_token {request.first_token} is outside the vocabulary")
        source = KVLayout.from_json(request.kv_layout) if request.kv_layout else None
        if source is not None:
            problem = exchange_problem(source, self.instance.kv_layout)
            if problem:
                raise ValueError(f"the request's KV ({source.describe()}) cannot become this instance's "
                                 f"({self.instance.kv_layout.describe()}): {problem}")
            if source.same_blocks(self.instance.kv_layout):
                source = None
        block_size = source.block_size if source is not None else engine.block_size
        expected = -(-len(seq.prompt) // block_size)
        if len(request.kv_keys) != expected:
            raise ValueError(f"kv_keys has {len(request.kv_keys)} keys, the prompt needs {expected}")
        return seq, source

    def _start(self, seq: Sequence, request, stream: TokenStream, source: KVLayout | None = None) -> None:
        """Stage the request's KV on a transfer thread, then admit it on the engine loop (retried, a few times, for
        cached blocks the engine evicted meanwhile). KV of another layout (``source``) is fetched from the prefill
        instance in that layout and converted to this instance's blocks, under this instance's own block keys."""
        inst = self.instance
        if source is None:
            keys = list(request.kv_keys)
            stage = functools.partial(self._stage, source=request.kv_source)
        else:
            keys = request_keys(seq, inst.engine.block_size)
            stage = functools.partial(self._stage_converted, request=request, source=source, own_keys=keys)
        timeout = inst.config.request_timeout_s
        if len(inst.loop.running) >= inst.engine.max_batch:  # before any I/O; the scheduler decides for good
            raise LateRejection(f"decode batch is full ({inst.engine.max_batch} sequences)")
        staged: dict = {}
        need = [key for key in keys if inst.engine.kv.page_of(key) is None]
        for _ in range(3):
            if need:
                staged.update(wait(inst.transfers.submit(stage, need), timeout))
            future = inst.loop.submit(lambda engine: self._admit(engine, seq, keys, request, stream,
                                                                 staged),
                                      joins_batch=True, wait_for_room=False)
            try:
                need = wait(future, timeout)
            except BatchFull as e:
                raise LateRejection(str(e)) from None
            except TimeoutError:
                if not future.cancel():
                    inst.loop.cancel(seq)
                raise
            if not need:
                return
        raise LateRejection("the request's cached KV kept being evicted while its other blocks were staged")

    def _stage(self, keys: list, source: str) -> dict:
        """On a transfer thread: the blocks of ``keys`` from this pool (fetched from ``source`` if evicted here),
        as host arrays by key."""
        inst = self.instance
        with inst.pool.pin(keys):
            blocks = inst.pool.get_many(keys)
            absent = [key for key, block in zip(keys, blocks) if block is None]
            if absent and source:  # evicted from this pool since the push: fetch them again
                inst.messenger(source).fetch(absent)
                blocks = inst.pool.get_many(keys)
                absent = [key for key, block in zip(keys, blocks) if block is None]
        if absent:
            raise MissingKV(f"{len(absent)} of the request's KV blocks are not in this instance's pool")
        return dict(zip(keys, blocks))

    def _stage_converted(self, keys: list, request, source: KVLayout, own_keys: list) -> dict:
        """On a transfer thread: the request's blocks in the prefill instance's layout ``source``, fetched from it
        (``kv_source``) without entering this pool (it holds only this instance's layout), converted to this
        instance's blocks: by key, for the ``keys`` (of ``own_keys``) asked for."""
        inst = self.instance
        if not request.kv_source:
            raise MissingKV("the request's KV is in another layout and no kv_source was given to fetch it from")
        spec = BlockSpec(source.block_shape, source.dtype)
        blocks = inst.messenger(request.kv_source).fetch_blocks(list(request.kv_keys), spec)
        converted = convert(np.stack(blocks), source, inst.kv_layout, len(request.prompt))
        wanted = set(keys)
        return {key: block for key, block in zip(own_keys, converted) if key in wanted}

    def _admit(self, engine: Engine, seq: Sequence, keys: list, request, stream: TokenStream,
               staged: dict) -> list:
        """On the engine loop (the scheduler saw a free slot): the late check, the staged KV into pages, and into
        the batch. Returns the keys that must be staged first (cached blocks evicted since), else []."""
        inst = self.instance
        running = inst.loop.running
        context = sum(s.num_tokens for s in running)
        if inst.costs is not None and inst.tbt_slo_s is not None and not decode_accepts(
                inst.costs.decode, len(running), context, seq.max_len, inst.tbt_slo_s):
            raise LateRejection(f"adding this request would exceed the cluster's TBT SLO of {inst.tbt_slo_s} s")
        present = [engine.kv.page_of(key) for key in keys]
        lacking = [key for key, page in zip(keys, present) if page is None and key not in staged]
        if lacking:
            return lacking
        load = [key for key, page in zip(keys, present) if page is None]
        if load:
            try:  # the request's blocks already in pages are held while room is made for the others
                engine.load_blocks(load, np.stack([staged[key] for key in load]),
                                   protect=[p for p in present if p is not None])
            except OutOfPages as e:
                raise LateRejection(f"no room for the request's KV: {e}") from None
        pages = [engine.kv.page_of(key) for key in keys]
        try:
            first = logprob_entry(request.first_logprob) if seq.params.logprobs is not None else None
            engine.adopt(seq, pages, request.first_token, first)
        except OutOfPages as e:
            raise LateRejection(f"no room for the request's KV: {e}") from None
        inst.loop.join_batch(seq, stream)
        return []
