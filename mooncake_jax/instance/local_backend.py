"""One engine doing both prefill and decode (coupled, like a single vLLM server) as a gateway ``Backend``.

The baseline the disaggregated cluster is compared with, and the simplest way to serve a model: each request goes
through the engine's scheduler, which prefills it on the engine loop once the batch has a slot and the KV cache its
pages (a long prompt delays the running batch's next token, which is what disaggregation avoids), and then decodes
it in the continuous batch. A request waits in the scheduler's bounded queue while running requests will free
room; a full queue, or pages that nothing running could free, reject it with a retry hint (HTTP 429).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..gateway.backend import (FINISH_ABORT, REJECT_EARLY, Finished, GenerateRequest, InvalidRequest, Rejected,
                               TokenOut, Unavailable, paper_tbt)
from ..llm import LLM
from ..model.kv_cache import OutOfPages
from ..model.sequence import Sequence
from ..engine.runner_loop import LoopStopped, RunnerLoop, TokenStream, wait
from ..engine.scheduler import DEFAULT_MAX_WAITING, QueueFull
from .rpc import sampling_of


class EngineBackend:
    """Serves ``llm``'s engine on its own loop thread."""

    def __init__(self, llm: LLM, model_name: str = "model", timeout_s: float = 120.0,
                 max_waiting: int = DEFAULT_MAX_WAITING):
        self.engine = llm.engine
        cfg = llm.config
        self.model_name, self.vocab_size, self.max_context = model_name, cfg.vocab_size, cfg.max_seq_len
        self.eos_token_id = cfg.eos_token_id
        self.timeout_s = timeout_s
        self.loop = RunnerLoop(self.engine, name="engine-coupled", max_waiting=max_waiting).start()
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "rejected": 0, "prompt_tokens": 0, "cached_tokens": 0}

    def stats(self) -> dict[str, float]:
        with self._lock:
            counts = {f"engine_{k}_total": float(v) for k, v in self._counts.items()}
        return counts | {"engine_running": float(len(self.loop.running)),
                         "engine_queued_jobs": float(self.loop.queued_jobs),
                         "engine_kv_usage": self.engine.pages_in_use / max(1, self.engine.num_pages - 1)}

    def _count(self, **amounts) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    def generate(self, request: GenerateRequest, cancelled: threading.Event | None = None
                 ) -> Iterator[TokenOut | Finished]:
        t0 = time.perf_counter()
        params = sampling_of(request)
        try:
            seq = self.engine.new_sequence(request.prompt, params)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self._count(requests=1, prompt_tokens=len(seq.prompt))
        stream = TokenStream(timeout_s=self.timeout_s)
        future = None
        try:
            future = self.loop.add_request(seq, stream)
            wait(future, self.timeout_s)
        except OutOfPages as e:
            self._count(rejected=1)
            raise Rejected(f"the engine's KV cache is full: {e}", 1.0, REJECT_EARLY, cause="kv_cache_full") from None
        except QueueFull as e:
            self._count(rejected=1)
            raise Rejected(str(e), 1.0, REJECT_EARLY, cause="queue_full") from None
        except (LoopStopped, TimeoutError) as e:
            if future is not None and not future.cancel():  # too late to unqueue it: stop it in the batch
                self.loop.cancel(seq)
            raise Unavailable(str(e)) from None
        self._count(cached_tokens=seq.cached_tokens)
        times = []
        try:
            for token in self._tokens(seq, stream, cancelled):
                times.append(time.perf_counter() - t0)
                i = len(times) - 1
                yield TokenOut(token, i, times[-1], seq.logprobs[i] if params.logprobs is not None else None,
                               seq.prompt_logprobs if i == 0 else None)
        except LoopStopped as e:
            raise Unavailable(str(e)) from None
        yield Finished(reason=stream.finish_reason or FINISH_ABORT, prompt_tokens=len(seq.prompt),
                       output_tokens=len(times), cached_tokens=seq.cached_tokens,
                       ttft_s=times[0] if times else 0.0, tbt_s=paper_tbt(times))

    def _tokens(self, seq: Sequence, stream: TokenStream, cancelled: threading.Event | None):
        yield seq.output[0]
        for token in stream:
            if cancelled is not None and cancelled.is_set():
                self.loop.cancel(seq)
                for _ in stream:  # drain until the loop confirms the abort
                    pass
                return
            yield token

    def close(self) -> None:
        self.loop.stop()


class CoupledServer:
    """A coupled engine ready for the gateway (``mooncake-jax serve --coupled``): the same interface as a
    ``Cluster`` for serving, without a Conductor or instances."""

    def __init__(self, model: str = "tiny", *, prefill_chunk_size: int = 512, max_batch: int = 32,
                 warmup: bool = True, compile_cache: str | None = ""):
        if compile_cache is not None:
            from ..model.compile_cache import enable_compilation_cache

            enable_compilation_cache(compile_cache or None)
        llm = LLM(model, prefill_chunk_size=prefill_chunk_size, max_batch=max_batch, bucket_factor=4)
        if warmup:
            llm.engine.warmup()
        self.backend = EngineBackend(llm, model_name=str(model))
        self.model_name = str(model)
        self.gateway = None

    def addresses(self) -> list[tuple[str, str]]:
        return [("engine", "in-process")]

    def serve_gateway(self, **kwargs):
        from ..gateway import GatewayServer

        self.gateway = GatewayServer(self.backend, **kwargs).start()
        return self.gateway

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.backend.close()

    def __enter__(self) -> "CoupledServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
