"""Turn what a front end parsed into a ``GenerateRequest``, or an ``InvalidRequest`` that says what is wrong.

Both front ends check only the *types* of their own wire format (JSON or protobuf) and then come here, so a
value is judged by the same rule, with the same message, whichever way it arrived.

Stopping: the request's ``stop_token_ids`` also carry every EOS id the tokenizer's files name (an instruct model
may end a turn with any of several), unless ``ignore_eos``; the backend stops on all of them.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import uuid

from mooncake_jax.gateway.backend import Backend, GenerateRequest, InvalidRequest
from mooncake_jax.gateway.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # as the engine's sampling.MAX_LOGPROBS (the gateway imports no model code)
MAX_LOGIT_BIAS = 64  # as sampling.MAX_LOGIT_BIAS


@dataclasses.dataclass
class Params:
    """A request as parsed from the wire; ``None`` means the client left the field out."""

    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    request_id: str | None = None
    add_special_tokens: bool = True  # False for a chat prompt whose template already wrote the BOS token
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None  # token id (an int, or its decimal string as JSON keys are) -> bias
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo_only: bool = False  # max_tokens 0 with echo: one token is generated (prefill) and not returned


@dataclasses.dataclass
class Prepared:
    """A validated request: what the backend gets, plus what only the gateway acts on."""

    request: GenerateRequest
    stop: tuple[str, ...]
    text_prompt: bool  # the prompt came as text (so the client gets text back)


def prepare(params: Params, backend: Backend, tokenizer: Tokenizer) -> Prepared:
    prompt = _prompt(params, backend, tokenizer)
    max_tokens = DEFAULT_MAX_TOKENS if params.max_tokens is None else params.max_tokens
    if max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}")
    if len(prompt) + max_tokens > backend.max_context:
        raise InvalidRequest(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                             f"model's context of {backend.max_context} tokens")
    temperature = 0.0 if params.temperature is None else params.temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {temperature}")
    top_p = 1.0 if params.top_p is None else params.top_p
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    seed = secrets.randbits(32) if params.seed is None else params.seed
    if not 0 <= seed < 2**32:
        raise InvalidRequest(f"seed must be in [0, 2**32), got {seed}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
    if any(not s for s in params.stop):
        raise InvalidRequest("stop strings must not be empty")
    for i, s in enumerate(params.stop):
        _check_unicode(f"stop string {i}", s)
    _check_ids("stop token", params.stop_token_ids, backend.vocab_size)
    stop_ids = tuple(params.stop_token_ids)
    if not params.ignore_eos:
        eos = getattr(tokenizer, "eos_token_ids", ())
        stop_ids += tuple(t for t in eos if t not in stop_ids and 0 <= t < backend.vocab_size)
    request = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=float(temperature),
                              top_p=float(top_p), seed=seed, stop_token_ids=stop_ids,
                              ignore_eos=params.ignore_eos, request_id=params.request_id or uuid.uuid4().hex,
                              **_extra_sampling(params, backend.vocab_size))
    return Prepared(request, tuple(params.stop), text_prompt=params.prompt_text is not None)


def _extra_sampling(params: Params, vocab_size: int) -> dict:
    """top-k, min-p, penalties, logit bias and logprobs, judged as vLLM does (0 or -1 turns top-k off)."""
    top_k = 0 if params.top_k is None else params.top_k
    if top_k < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (off) or a positive integer, got {top_k}")
    min_p = 0.0 if params.min_p is None else params.min_p
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise InvalidRequest(f"min_p must be in [0, 1], got {min_p}")
    repetition = 1.0 if params.repetition_penalty is None else params.repetition_penalty
    if not (math.isfinite(repetition) and 0 < repetition <= 100):
        raise InvalidRequest(f"repetition_penalty must be in (0, 100] (1: off), got {repetition}")
    penalties = {}
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        value = 0.0 if value is None else value
        if not (math.isfinite(value) and -2 <= value <= 2):
            raise InvalidRequest(f"{name} must be in [-2, 2], got {value}")
        penalties[name] = float(value)
    bias = []
    for key, value in (params.logit_bias or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidRequest(f"logit_bias of token {token} must be a number in [-100, 100], got {value!r}")
        bias.append((token, float(value)))
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
    return dict(top_k=max(top_k, 0), min_p=float(min_p), repetition_penalty=float(repetition),
                logit_bias=tuple(bias), logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
                **penalties)


def _prompt(params: Params, backend: Backend, tokenizer: Tokenizer) -> list[int]:
    if params.prompt_ids is not None and params.prompt_text is not None:
        raise InvalidRequest("give the prompt as token ids or as text, not both")
    if params.prompt_text is not None:
        if not params.prompt_text:
            raise InvalidRequest("the prompt is empty")
        _check_unicode("the prompt", params.prompt_text)
        prompt = tokenizer.encode(params.prompt_text, add_special_tokens=params.add_special_tokens)
    else:
        prompt = list(params.prompt_ids or ())
        if not prompt:
            raise InvalidRequest("the prompt is empty")
    _check_ids("prompt token", prompt, backend.vocab_size)
    if len(prompt) >= backend.max_context:
        raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the model's context is {backend.max_context} "
                             f"tokens, including the generated ones")
    return prompt


def _check_ids(what: str, ids, vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"{what} {i} (id {t}) is outside the vocabulary [0, {vocab_size})")


def _check_unicode(what: str, text: str) -> None:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{what} contains a lone surrogate (U+{ord(text[e.start]):04X} at character "
                             f"{e.start}), which is not valid Unicode") from None
