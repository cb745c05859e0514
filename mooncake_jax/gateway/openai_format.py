"""OpenAI's completions wire format: request bodies in, response objects, stream chunks and errors out.

Only JSON types are judged here (a string where a number belongs, a float ``max_tokens``); values are judged by
``validate.prepare`` like any other request. Options that would change the meaning of the answer and are not
implemented (``n`` > 1, ``echo``, ``logprobs``, penalties, ...) are refused rather than silently ignored;
fields OpenAI clients send that change nothing (``user``) are ignored.

Extensions beside OpenAI's fields: ``stop_token_ids`` and ``ignore_eos`` in the request (as vLLM), and in the
answer ``token_ids`` per choice, ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI's chat API) and
``timing`` (TTFT and TBT as the gateway measured them).
"""

from __future__ import annotations

import numbers
import time

from mooncake_jax.gateway.backend import InvalidRequest
from mooncake_jax.gateway.stream import Summary
from mooncake_jax.gateway.validate import Params

# Options refused unless they have their neutral value.
_NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None,), "suffix": (None, ""),
            "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}


def parse_completion(body) -> tuple[Params, str | None, bool, bool]:
    """``(params, model or None, stream, include_usage)`` of a ``POST /v1/completions`` body."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for key, neutral in _NEUTRAL.items():
        if key in body and not any(_same(body[key], v) for v in neutral):
            raise InvalidRequest(f"{key}={body[key]!r} is not supported by this server")
    model = _typed(body, "model", str)
    ids, text = _prompt(body.get("prompt"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("stop must be a string or a list of strings")
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest("stream_options.include_usage must be a boolean")
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        raise InvalidRequest("stop_token_ids must be a list of integers")
    params = Params(prompt_ids=ids, prompt_text=text, max_tokens=_typed(body, "max_tokens", int),
                    temperature=_typed(body, "temperature", float), top_p=_typed(body, "top_p", float),
                    seed=_typed(body, "seed", int), stop=tuple(stop or ()), stop_token_ids=tuple(stop_ids),
                    ignore_eos=_typed(body, "ignore_eos", bool) or False)
    return params, model, stream, include_usage


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


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object"}


def _typed(body: dict, key: str, kind: type):
    """``body[key]`` if it has JSON type ``kind`` (null counts as absent), else InvalidRequest."""
    value = body.get(key)
    if value is None:
        return None
    ok = {int: _is_int, float: _is_number}.get(kind, lambda v: isinstance(v, kind))(value)
    if not ok:
        raise InvalidRequest(f"{key} must be {_TYPE_NAMES[kind]}, got {value!r}")
    return float(value) if kind is float else value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


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


def models(model: str, max_context: int, created: int | None = None) -> dict:
    return {"object": "list", "data": [model_card(model, max_context, created)]}


def model_card(model: str, max_context: int, created: int | None = None) -> dict:
    return {"id": model, "object": "model", "created": int(created or time.time()), "owned_by": "mooncake-jax",
            "max_model_len": max_context}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}


def error(status: int, message: str, **extra) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": None,
                      "code": status, **extra}}
