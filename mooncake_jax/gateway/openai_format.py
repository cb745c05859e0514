"""OpenAI's completions and chat completions wire format: request models in, response objects, stream chunks and
errors out.

Requests are pydantic models with ``extra="forbid"`` and strict types, so a field this server does not know
(``top_k``, a typo) is a 400 naming it instead of being silently ignored, and a string where a number belongs
is a 400 naming the field; values are judged by ``validate.prepare`` like any other request. Options that would
change the meaning of the answer and are not implemented (``n`` > 1, ``echo``, ``logprobs``, penalties, ...) are
refused unless they have their neutral value; fields OpenAI clients send that change nothing (``user``) are
accepted and ignored.

Extensions beside OpenAI's fields: ``stop_token_ids`` and ``ignore_eos`` in the request (as vLLM), and in the
answer ``token_ids`` per choice, ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI's chat API) and
``timing`` (TTFT and TBT as the gateway measured them). Chat requests also take vLLM's
``add_generation_prompt`` and ``chat_template_kwargs``.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mooncake_jax.gateway.backend import InvalidRequest
from mooncake_jax.gateway.stream import Summary
from mooncake_jax.gateway.validate import Params

# Options refused unless they have their neutral value.
_NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
            "top_logprobs": (None, 0), "suffix": (None, ""), "presence_penalty": (None, 0),
            "frequency_penalty": (None, 0), "logit_bias": (None, {})}


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
                stop=tuple(stop or ()), stop_token_ids=tuple(stop_ids), ignore_eos=req.ignore_eos or False)


def _options(req: _Sampling) -> tuple[str | None, bool, bool]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return req.model, bool(req.stream), include_usage


def parse_completion(body) -> tuple[Params, str | None, bool, bool]:
    """``(params, model or None, stream, include_usage)`` of a ``POST /v1/completions`` body."""
    req = _validated(CompletionRequest, body)
    common = _common(req)
    ids, text = _prompt(req.prompt)
    return Params(prompt_ids=ids, prompt_text=text, **common), *_options(req)


def parse_chat(body, template) -> tuple[Params, str | None, bool, bool]:
    """``(params, model or None, stream, include_usage)`` of a ``POST /v1/chat/completions`` body; the prompt is
    the messages rendered by ``template`` (a ``chat.ChatTemplate``; None: 400)."""
    req = _validated(ChatRequest, body)
    common = _common(req)
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
    params = Params(prompt_text=text, add_special_tokens=not has_bos, **common)
    return params, *_options(req)


def _prompt(prompt) -> tuple[list[int] | None, str | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise InvalidRequest("prompt is required: a string or a list of token ids")
    if isinstance(prompt, str):
        return None, prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return list(prompt), None
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest("batched prompts are not supported: send one prompt per request")
    raise InvalidRequest("prompt must be a string or a list of token ids (integers)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def completion_id(request_id: str) -> str:
    return f"cmpl-{request_id}"


def usage(summary: Summary) -> dict:
    return {"prompt_tokens": summary.prompt_tokens, "completion_tokens": summary.output_tokens,
            "total_tokens": summary.prompt_tokens + summary.output_tokens,
            "prompt_tokens_details": {"cached_tokens": summary.cached_tokens}}


def timing(summary: Summary) -> dict:
    return {"ttft_s": summary.ttft_s, "tbt_s": summary.tbt_s, "total_s": summary.total_s}


def completion(model: str, created: int, text: str, token_ids: list[int], summary: Summary) -> dict:
    """The non-streaming answer."""
    return {"id": completion_id(summary.request_id), "object": "text_completion", "created": created,
            "model": model, "choices": [{"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                                          "finish_reason": summary.reason}],
            "usage": usage(summary), "timing": timing(summary)}


def chunk(request_id: str, model: str, created: int, text: str, token_ids: list[int],
          summary: Summary | None = None) -> dict:
    """One streamed piece; the last one (with ``summary``) carries the finish reason and usage."""
    body = {"id": completion_id(request_id), "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                         "finish_reason": summary.reason if summary else None}]}
    if summary is not None:
        body["usage"] = usage(summary)
        body["timing"] = timing(summary)
    return body


def usage_chunk(model: str, created: int, summary: Summary) -> dict:
    """The extra closing chunk of ``stream_options.include_usage``: no choices, only usage."""
    return {"id": completion_id(summary.request_id), "object": "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(summary)}


def chat_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def chat_completion(model: str, created: int, text: str, token_ids: list[int], summary: Summary) -> dict:
    """The non-streaming chat answer."""
    return {"id": chat_id(summary.request_id), "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": token_ids,
                         "logprobs": None, "finish_reason": summary.reason}],
            "usage": usage(summary), "timing": timing(summary)}


def chat_chunk(request_id: str, model: str, created: int, text: str, token_ids: list[int],
               summary: Summary | None = None, first: bool = False) -> dict:
    """One streamed chat piece: the first carries the assistant role, the last the finish reason and usage."""
    delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    body = {"id": chat_id(request_id), "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "token_ids": token_ids, "logprobs": None,
                         "finish_reason": summary.reason if summary else None}]}
    if summary is not None:
        body["usage"] = usage(summary)
        body["timing"] = timing(summary)
    return body


def chat_usage_chunk(model: str, created: int, summary: Summary) -> dict:
    return {"id": chat_id(summary.request_id), "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [], "usage": usage(summary)}


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
