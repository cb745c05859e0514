"""``mj.LLM``: the Python API over one local engine (DESIGN.md section 4).

    llm = mj.LLM("tiny")
    llm.generate([[1, 5, 9], [1, 7]], max_new_tokens=16, temperature=0.0)   # -> new tokens per prompt
    llm.generate("Once upon a time")                                          # -> the new text
    llm.generate(["a", "b"]); llm.chat([{"role": "user", "content": "hi"}])   # -> texts; the reply's text
    llm.score([1, 5, 9, 4]); llm.score("text")                                # -> logits [n_tokens, vocab]

Text goes through the model folder's tokenizer (tokenizer.json; raw bytes for a preset, which has no vocabulary),
and generation stops on every EOS id the folder's files name, as the server does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from collections import deque
from collections.abc import Iterator

from .engine.scheduler import DEFAULT_MAX_WAITING, Scheduler
from .model.config import PRESETS, ModelConfig, get_config, resolve_dtype
from .model.engine import DEFAULT_KV_CACHE_BYTES, Engine
from .model.llama import Llama, init_model
from .model.sequence import SamplingParams, validate_prompt
from .sharding.layout import MeshLayout
from .sharding.mesh import MeshSpec


def build_model(model: str | Path, *, block_size: int | None = None, dtype: str | None = None,
                seed: int = 0, attention: str | None = None) -> Llama:
    """A preset with dummy weights from ``seed``, or a local Hugging Face folder's weights."""
    cfg = get_config(model)
    changes = {}
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        changes["block_size"] = block_size
    if dtype is not None:
        resolve_dtype(dtype)
        changes["dtype"] = dtype
    if attention is not None:
        changes["attention"] = attention  # validated by ModelConfig
    cfg = cfg.replace(**changes)
    if isinstance(model, str) and model in PRESETS:
        return init_model(cfg, seed)
    from .model.weights import load_hf

    return load_hf(model, cfg)


class LLM:
    """A model with its engine: batched generation and scoring on the local devices.

    ``tensor_parallel`` splits each layer over that many devices; ``pipeline_stages`` splits the layers into that
    many stages whose prefill runs as a chunked pipeline (chunks of ``prefill_chunk_size`` tokens). Both together
    use ``tensor_parallel * pipeline_stages`` devices.
    """

    def __init__(self, model: str | Path = "tiny", *, tensor_parallel: int = 1, pipeline_stages: int = 1,
                 prefill_chunk_size: int = 512, block_size: int | None = None, dtype: str | None = None,
                 seed: int = 0, max_batch: int = 32, num_pages: int | None = None,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, prefix_caching: bool = True, bucket_factor: int = 2,
                 max_waiting: int = DEFAULT_MAX_WAITING, attention: str | None = None):
        if isinstance(prefill_chunk_size, bool) or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be a positive integer, got {prefill_chunk_size!r}")
        for name, value in (("tensor_parallel", tensor_parallel), ("pipeline_stages", pipeline_stages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        spec = MeshSpec(stage=pipeline_stages, tensor=tensor_parallel)
        if spec.devices > len(jax.devices()):
            raise ValueError(f"tensor_parallel={tensor_parallel} x pipeline_stages={pipeline_stages} needs "
                             f"{spec.devices} devices but only {len(jax.devices())} exist")
        self.model = build_model(model, block_size=block_size, dtype=dtype, seed=seed, attention=attention)
        self.config: ModelConfig = self.model.cfg
        layout = None if spec.devices == 1 else MeshLayout(self.config, spec)
        self.engine = Engine(self.model, num_pages=num_pages, kv_cache_bytes=kv_cache_bytes, max_batch=max_batch,
                             prefill_chunk_size=prefill_chunk_size, prefix_caching=prefix_caching, layout=layout,
                             bucket_factor=bucket_factor)
        self.scheduler = Scheduler(self.engine, max_waiting=max_waiting)  # generate's continuous batching
        self._source = model
        self._tokenizer = None
        self._chat_template = None

    @property
    def tokenizer(self):
        """The model's tokenizer (loaded on first use; a folder without tokenizer.json is a ValueError)."""
        if self._tokenizer is None:
            from .gateway.tokenizer import tokenizer_for

            self._tokenizer = tokenizer_for(self._source, self.config.vocab_size)
        return self._tokenizer

    def _text_stops(self) -> tuple[int, ...]:
        return tuple(t for t in getattr(self.tokenizer, "eos_token_ids", ()) if 0 <= t < self.config.vocab_size)

    def chat(self, messages: list[dict], max_new_tokens: int = 256, chat_template: str | Path | None = None,
             **sampling) -> str:
        """The assistant's reply to ``messages`` (``[{"role": ..., "content": ...}, ...]``), rendered with the model
        folder's chat template (or the Jinja file ``chat_template``); ValueError when there is none."""
        return "".join(self.stream_chat(messages, max_new_tokens, chat_template, **sampling))

    def stream_chat(self, messages: list[dict], max_new_tokens: int = 256, chat_template: str | Path | None = None,
                    **sampling) -> Iterator[str]:
        """``chat``, piece by piece: each piece of the reply's text as soon as its token is sampled (an unfinished
        UTF-8 character waits for its last byte), for an interactive loop that shows the reply as it is written.
        Closing the iterator early stops the generation and frees its pages."""
        from .gateway.chat import load_chat_template

        template = load_chat_template(self.tokenizer, chat_template) if chat_template is not None else None
        if template is None:
            if self._chat_template is None:  # the model's own, loaded once
                self._chat_template = load_chat_template(self.tokenizer, None)
            template = self._chat_template
        if template is None:
            raise ValueError("this model has no chat template (no chat_template in tokenizer_config.json, no "
                             "chat_template.jinja): pass chat_template=<a Jinja file>")
        text, has_bos = template.render(list(messages), add_generation_prompt=True)
        prompt = self.tokenizer.encode(text, add_special_tokens=not has_bos)
        stops = self._text_stops()
        sampling["stop_token_ids"] = tuple(sampling.get("stop_token_ids", ())) + stops
        seq = self._new_sequences([prompt], self._params(max_new_tokens=max_new_tokens, **sampling))[0]
        detok = self.tokenizer.detokenizer()
        for token in self._stream(seq):
            if token not in stops:
                piece = detok.add(token)
                if piece:
                    yield piece
        rest = detok.flush()
        if rest:
            yield rest

    def _stream(self, seq) -> Iterator[int]:
        """``seq``'s new tokens as the scheduler samples them, stepping it on this thread."""
        sched, seen = self.scheduler, 0
        future = sched.add_request(seq)
        try:
            while sched.has_work:
                sched.step()
                if future.done() and future.exception() is not None:
                    raise future.exception()
                while seen < len(seq.output):
                    seen += 1
                    yield seq.output[seen - 1]
        except GeneratorExit:  # the caller stopped reading: end the sequence, return its pages
            sched.cancel(seq)
            while sched.has_work:
                sched.step()
            raise
        except BaseException as e:
            sched.abort_all(e)
            raise

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, eos_token_id: int | None = None, ignore_eos: bool = False, **sampling):
        """New tokens for each prompt (a list of token-id lists), decoded together with continuous batching; or,
        for a text prompt (a string, or a list of strings), the new text (a string, or a list of them), stopping
        also on every EOS id of the model folder.

        Stops at ``max_new_tokens`` or at EOS (which is included in token output, not in text). ``sampling``: any
        other ``SamplingParams`` field (``top_k``, ``min_p``, ``repetition_penalty``, ``frequency_penalty``,
        ``presence_penalty``, ``logit_bias``, ``stop_token_ids``). All prompts are validated before any work
        starts: a bad one raises ValueError naming it.
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(p, str) for p in prompts)):
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            stops = () if ignore_eos else self._text_stops()
            sampling["stop_token_ids"] = tuple(sampling.get("stop_token_ids", ())) + stops
            outs = self.generate([self.tokenizer.encode(t) for t in texts], max_new_tokens, temperature, top_p,
                                 seed, eos_token_id, ignore_eos, **sampling)
            decoded = [self.tokenizer.decode([t for t in out if t not in stops]) for out in outs]
            return decoded[0] if isinstance(prompts, str) else decoded
        if isinstance(prompts, bytes) or not hasattr(prompts, "__len__"):
            raise ValueError("prompts must be text, a list of texts, or a list of token-id lists, e.g. [[1, 5, 9]]")
        if len(prompts) and np.isscalar(prompts[0]):
            raise ValueError("prompts must be a list of token-id lists; wrap a single prompt: [[1, 5, 9]]")
        params = self._params(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              eos_token_id=eos_token_id, ignore_eos=ignore_eos, **sampling)
        seqs = self._new_sequences(prompts, params)
        self._run(seqs)
        return [list(s.output) for s in seqs]

    def _params(self, **sampling) -> SamplingParams:
        unknown = set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown:
            raise ValueError(f"unknown sampling option(s) {sorted(unknown)}")
        eos_token_id = sampling.get("eos_token_id")
        if eos_token_id is not None and not 0 <= eos_token_id < self.config.vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary [0, {self.config.vocab_size})")
        return SamplingParams(**sampling)

    def _new_sequences(self, prompts, params: SamplingParams) -> list:
        """A validated sequence per prompt, all checked before any work starts (a bad one: ValueError naming it)."""
        seqs = []
        for i, prompt in enumerate(prompts):
            try:
                seqs.append(self.engine.new_sequence(prompt, params))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return seqs

    def _run(self, seqs) -> None:
        """Continuous batching on this thread: the scheduler's queue is fed as it has room, steps until done."""
        sched, pending, futures = self.scheduler, deque(seqs), []
        try:
            while pending or sched.has_work:
                while pending and sched.has_room:
                    futures.append(sched.add_request(pending.popleft()))
                sched.step()
                for future in futures:
                    if future.done() and future.exception() is not None:
                        raise future.exception()
                futures = [f for f in futures if not f.done()]
        except BaseException as e:
            sched.abort_all(e)
            raise

    def score(self, tokens) -> np.ndarray:
        """Float32 logits [n_tokens, vocab] at every position of ``tokens`` (token ids, or text: then its tokens
        as the model's tokenizer encodes it) (no cache reuse, nothing sampled)."""
        if isinstance(tokens, str):
            tokens = self.tokenizer.encode(tokens)
        tokens = validate_prompt(tokens, self.config)
        seq = self.engine.new_sequence(tokens, SamplingParams(max_new_tokens=1))
        self.engine.admit(seq, cached_pages=[])
        try:
            return self.engine.prefill(seq, all_logits=True, sample=False)
        finally:
            self.engine.release(seq)
