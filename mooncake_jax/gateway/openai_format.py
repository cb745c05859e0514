"""OpenAI's completions and chat completions wire format: request models in, response objects, stream chunks and
errors out.

Requests are pydantic models with ``extra="forbid"`` and strict types, so a field this server does not know
(``top_k``, a typo) is a 400 naming it instead of being silently ignored, and a string where a number belongs
is a 400 naming the field; values are judged by ``validate.prepare`` like any other request. Options that would
change the meaning of the answer and are not implemented (``best_of`` > 1, ``suffix``) are refused unless they
have their neutral value; fields OpenAI clients send that change nothing (``user``) are accepted and ignored.

A completions request fans out into choices: every prompt of a batch times ``n``, choice ``i * n + j`` being
sample ``j`` of prompt ``i`` (as vLLM numbers them); with a ``seed`` sample ``j`` uses ``seed + j``. ``echo``
puts the prompt before the completion, ``max_tokens`` 0 with ``echo`` returns the prompt only (and with
``logprobs`` the log-probability of every prompt token after the first: how evaluation harnesses score
multiple-choice answers).

Extensions beside OpenAI's fields: ``stop_token_ids`` and ``ignore_eos`` in the request (as vLLM), and in the
answer ``token_ids`` per choice, ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI's chat API) and
``timing`` (TTFT and TBT as the gateway measured them). Chat requests also take vLLM's
``add_generation_prompt`` and ``chat_template_kwargs``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mooncake_jax.gateway.backend import InvalidRequest
from mooncake_jax.gateway.stream import Summary
from mooncake_jax.gateway.validate import Params

# Options refused unless they have their neutral value.
_NEUTRAL = {"best_of": (None, 1), "suffix": (None, "")}
MAX_CHOICES = 128  # prompts x n of one request
MAX_N = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings: judged below, for one clear message
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop_token_ids: Any = None
    ignore_eos: bool | None = None
    user: str | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    logit_bias: dict | None = None


class CompletionRequest(_Sampling):
    prompt: Any = None  # a string, token ids, or a batch of one of them
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; fields beyond role and content (``name``, ``tool_calls``, ...) go to the template as sent."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None


_KINDS = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
          "bool_type": "a boolean", "string_type": "a string", "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object", "list_type": "a list"}


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "ContentPart"}


def _validated(model: type[BaseModel], body) -> BaseModel:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)  # of a union, the branch that got furthest says the most
        raise InvalidRequest(_message(max(errors, key=lambda error: len(error["loc"])))) from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None


def _message(error: dict) -> str:
    """One pydantic error in the words of this API: the field's dotted path and what it must be."""
    where = ".".join(str(part) for part in error["loc"]  # without the union branch tags pydantic adds
                     if not (isinstance(part, str) and (part in _BRANCHES or "[" in part)))
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown field {where!r}: this server does not support it"
    if kind == "missing":
        return f"{where} is required"
    if kind in _KINDS:
        return f"{where} must be {_KINDS[kind]}, got {error.get('input')!r}"[:300]
    return f"{where}: {error['msg']}"


@dataclasses.dataclass
class Parsed:
    """A request as this API reads it: one ``Params`` per choice, and how to answer."""

    choices: list[Params]
    model: str | None
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token (completions' logprobs, chat's top_logprobs)
    echo_only: bool = False  # max_tokens 0 with echo: the prompt only
    prompt_texts: list[str | None] = dataclasses.field(default_factory=list)  # per prompt, as sent


def _fan_out(base: Params, prompts: list[tuple[list[int] | None, str | None]], n: int) -> list[Params]:
    choices = []
    for ids, text in prompts:
        for j in range(n):
            seed = base.seed if base.seed is None or j == 0 else (base.seed + j) % 2**32  # j 0 is judged
            choices.append(dataclasses.replace(base, prompt_ids=ids, prompt_text=text, seed=seed))
    return choices


def _n(req: _Sampling) -> int:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
    return n


def _common(req: _Sampling) -> dict:
    for key, neutral in _NEUTRAL.items():
        value = getattr(req, key, None)
        if not any(_same(value, v) for v in neutral):
            raise InvalidRequest(f"{key}={value!r} is not supported by this server")
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("stop must be a string or a list of strings")
    stop_ids = req.stop_token_ids or []
    if not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        raise InvalidRequest("stop_token_ids must be a list of integers")
    return dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                stop=tuple(stop or ()), stop_token_ids=tuple(stop_ids), ignore_eos=req.ignore_eos or False,
                top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                logit_bias=req.logit_bias)


def _options(req: _Sampling) -> tuple[str | None, bool, bool]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return req.model, bool(req.stream), include_usage


def parse_completion(body) -> Parsed:
    """The choices and answer options of a ``POST /v1/completions`` body."""
    req = _validated(CompletionRequest, body)
    common = _common(req)
    n = _n(req)
    prompts = _prompts(req.prompt)
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts x n={n} is over the limit of {MAX_CHOICES} choices")
    echo = bool(req.echo)
    echo_only = echo and req.max_tokens == 0
    if req.max_tokens == 0 and not echo:
        raise InvalidRequest("max_tokens must be at least 1 (0 only with echo), got 0")
    if echo_only:
        common["max_tokens"] = 1
    if req.logprobs is not None and req.logprobs < 0:
        raise InvalidRequest(f"logprobs must be in [0, 20], got {req.logprobs}")
    base = Params(**common, logprobs=req.logprobs, echo_only=echo_only,
                  prompt_logprobs=req.logprobs if echo and req.logprobs is not None else None)
    model, stream, include_usage = _options(req)
    return Parsed(_fan_out(base, prompts, n), model, stream, include_usage, n=n, echo=echo,
                  logprobs=req.logprobs, echo_only=echo_only, prompt_texts=[text for _, text in prompts])


def parse_chat(body, template) -> Parsed:
    """The choices and answer options of a ``POST /v1/chat/completions`` body; the prompt is the messages
    rendered by ``template`` (a ``chat.ChatTemplate``; None: 400)."""
    req = _validated(ChatRequest, body)
    common = _common(req)
    n = _n(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise InvalidRequest("max_tokens and max_completion_tokens differ: give one")
        common["max_tokens"] = req.max_completion_tokens
    if not req.messages:
        raise InvalidRequest("messages must not be empty")
    if template is None:
        raise InvalidRequest("this model has no chat template (no chat_template in its tokenizer_config.json, no "
                             "chat_template.jinja, and the server was started without --chat-template): use "
                             "/v1/completions")
    messages = []
    for i, m in enumerate(req.messages):
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise InvalidRequest(f"messages.{i}.content: only text parts are supported")
            message["content"] = "".join(part.text for part in m.content)
        message.setdefault("content", "")
        messages.append(message)
    text, has_bos = template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                    extra=req.chat_template_kwargs)
    if not text:
        raise InvalidRequest("the chat template rendered an empty prompt")
    base = Params(add_special_tokens=not has_bos, logprobs=logprobs, **common)
    model, stream, include_usage = _options(req)
    return Parsed(_fan_out(base, [(None, text)], n), model, stream, include_usage, n=n, logprobs=logprobs,
                  prompt_texts=[text])


def _prompts(prompt) -> list[tuple[list[int] | None, str | None]]:
    """``(token ids, text)`` of every prompt: a string, token ids, or a non-empty list of either."""
    if prompt is None:
        raise InvalidRequest("prompt is required: a string, a list of token ids, or a list of either")
    if isinstance(prompt, str):
        return [(None, prompt)]
    if isinstance(prompt, list) and not prompt:
        raise InvalidRequest("the prompt is empty")
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return [(list(prompt), None)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                out.append((None, p))
            elif p and all(_is_int(t) for t in p):
                out.append((list(p), None))
            else:
                raise InvalidRequest(f"prompt {i} must be a string or a non-empty list of token ids (integers)")
        return out
    raise InvalidRequest("prompt must be a string, a list of token ids (integers), or a list of either")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def completion_id(request_id: str) -> str:
    return f"cmpl-{request_id}"


@dataclasses.dataclass
class Choice:
    """One choice of an answer, or its piece in one streamed chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: dict | None = None
    finish_reason: str | None = None


def usage(summaries: list[Summary], n: int = 1, echo_only: bool = False) -> dict:
    """Usage of a request's choices: each prompt counts once (not once per sample), completions all."""
    firsts = summaries[::n]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion_tokens = 0 if echo_only else sum(s.output_tokens for s in summaries)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}


def timing(summary: Summary) -> dict:
    return {"ttft_s": summary.ttft_s, "tbt_s": summary.tbt_s, "total_s": summary.total_s}


def completion_logprobs(token_text, ids: list[int], entries: list, offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object for tokens ``ids`` with their ``backend.Logprob`` entries (None
    for a token without one: the first prompt token); ``text_offset`` counts characters from ``offset``."""
    tokens = [token_text(t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else _top_by_text(token_text, e[1]) for e in entries],
            "text_offset": offsets}


def _top_by_text(token_text, alternatives) -> dict[str, float]:
    """Completions' top alternatives keyed by their text, best first; two tokens with the same text (e.g. two
    lone bytes of a character, both U+FFFD) keep the better one's log-probability, not the last one's."""
    top: dict[str, float] = {}
    for token, logprob in alternatives:
        top.setdefault(token_text(token), logprob)
    return top


def chat_logprobs(token_text, ids: list[int], entries: list) -> dict:
    """OpenAI's chat ``logprobs`` object (``content``: one entry per generated token)."""
    def item(token: str, lp: float) -> dict:
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    content = []
    for t, entry in zip(ids, entries):
        text = token_text(t)
        content.append(item(text, entry[0]) | {"top_logprobs": [item(token_text(a), lp) for a, lp in entry[1]]})
    return {"content": content}


def completion(model: str, created: int, request_id: str, choices: list[Choice], summaries: list[Summary],
               n: int = 1, echo_only: bool = False) -> dict:
    """The non-streaming answer."""
    return {"id": completion_id(request_id), "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(summaries, n, echo_only), "timing": timing(summaries[0])}


def chunk(request_id: str, model: str, created: int, choice: Choice, summary: Summary | None = None,
          n: int = 1) -> dict:
    """One streamed piece; the last one of a choice (with ``summary``) carries its finish reason and usage."""
    body = {"id": completion_id(request_id), "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": choice.index, "text": choice.text, "token_ids": choice.token_ids,
                         "logprobs": choice.logprobs, "finish_reason": choice.finish_reason}]}
    if summary is not None:
        body["usage"] = usage([summary])
        body["timing"] = timing(summary)
    return body


def usage_chunk(request_id: str, model: str, created: int, summaries: list[Summary], n: int = 1,
                echo_only: bool = False) -> dict:
    """The extra closing chunk of ``stream_options.include_usage``: no choices, only usage."""
    return {"id": completion_id(request_id), "object": "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(summaries, n, echo_only)}


def chat_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def chat_completion(model: str, created: int, request_id: str, choices: list[Choice], summaries: list[Summary],
                    n: int = 1, echo_only: bool = False) -> dict:
    """The non-streaming chat answer."""
    return {"id": chat_id(request_id), "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                        for c in choices],
            "usage": usage(summaries, n), "timing": timing(summaries[0])}


def chat_chunk(request_id: str, model: str, created: int, choice: Choice, summary: Summary | None = None,
               first: bool = False) -> dict:
    """One streamed chat piece: the first carries the assistant role, the last the finish reason and usage."""
    text = choice.text
    delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    body = {"id": chat_id(request_id), "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": choice.index, "delta": delta, "token_ids": choice.token_ids,
                         "logprobs": choice.logprobs, "finish_reason": choice.finish_reason}]}
    if summary is not None:
        body["usage"] = usage([summary])
        body["timing"] = timing(summary)
    return body


def chat_usage_chunk(request_id: str, model: str, created: int, summaries: list[Summary], n: int = 1,
                     echo_only: bool = False) -> dict:
    return {"id": chat_id(request_id), "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [], "usage": usage(summaries, n)}


def models(model: str, max_context: int, created: int | None = None) -> dict:
    return {"object": "list", "data": [model_card(model, max_context, created)]}


def model_card(model: str, max_context: int, created: int | None = None) -> dict:
    return {"id": model, "object": "model", "created": int(created or time.time()), "owned_by": "mooncake-jax",
            "max_model_len": max_context}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 411: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}


def error(status: int, message: str, **extra) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": None,
                      "code": status, **extra}}
