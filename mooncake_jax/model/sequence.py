"""What one request is while the engine works on it: its tokens, its sampling settings, its KV pages."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as SequenceABC

import numpy as np

from .config import ModelConfig
from .sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS

_ids = itertools.count()

FINISH_LENGTH, FINISH_STOP, FINISH_ABORT = "length", "stop", "abort"


@dataclasses.dataclass
class SamplingParams:
    """How to generate: ``temperature`` 0 is greedy; ``top_p`` < 1 samples from the nucleus; ``seed`` makes sampling
    reproducible; generation stops after ``max_new_tokens``, at EOS (the model's unless ``eos_token_id`` is given;
    ``ignore_eos`` ignores it) or at any of ``stop_token_ids`` (the stop token is the last output token).

    As vLLM: ``top_k`` (0: off) and ``min_p`` (0: off) narrow what a sampled row draws from;
    ``repetition_penalty`` (1: off) applies to prompt and output tokens, ``frequency_penalty`` and
    ``presence_penalty`` (0: off) to output tokens; ``logit_bias`` is ``((token id, bias), ...)`` added to the
    logits. ``logprobs`` (None: off) returns each generated token's log-probability and that many top alternatives;
    ``prompt_logprobs`` (None: off) does the same for every prompt token after the first (which disables prefix
    reuse for the request: a cached position has no logits)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, (int, np.integer)):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= int(self.seed) < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


def validate_prompt(prompt, cfg: ModelConfig, max_new_tokens: int = 0) -> list[int]:
    """The prompt as a list of ints, or ValueError saying what is wrong with it."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (SequenceABC, np.ndarray)):
        raise ValueError(f"a prompt must be a sequence of token ids, got {type(prompt).__name__}")
    arr = np.asarray(prompt)
    if arr.size == 0:
        raise ValueError("prompt is empty: give at least one token id")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"a prompt must be a flat sequence of integer token ids, got {arr.dtype} of shape "
                         f"{arr.shape}")
    bad = np.flatnonzero((arr < 0) | (arr >= cfg.vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"token id {int(arr[i])} at position {i} is outside the vocabulary [0, {cfg.vocab_size})")
    total = arr.size + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(f"prompt ({arr.size} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                         f"model's context of {cfg.max_seq_len} tokens")
    return arr.astype(int).tolist()


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request inside the engine. ``num_computed`` tokens have their KV in ``pages``; ``cached_tokens`` of them
    came from the prefix cache instead of being computed."""

    prompt: list[int]
    params: SamplingParams
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    reserved_pages: int = 0
    finish_reason: str | None = None
    prompt_keys: list[int] | None = None  # block keys of the prompt, computed once by the engine
    # with params.logprobs: per output token (its logprob, ((top id, logprob), ...)); with params.prompt_logprobs:
    # the same for prompt tokens 1.. (token 0 has no context)
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """``len(tokens)`` without building the list (the decode loop asks every step)."""
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens
