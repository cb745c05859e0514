"""The client-facing gateway: gRPC ``mooncake.v1.Gateway/Generate`` (server-streaming) and OpenAI-compatible HTTP
over any ``Backend`` (``backend.py``: the disaggregated cluster, a single engine, or a fake in tests).

Usage::

    from mooncake_jax.gateway import GatewayServer

    with GatewayServer(backend, host="127.0.0.1", grpc_port=0, http_port=0, auth_token=None,
                       model_name=None, tokenizer=None) as gw:
        print(gw.grpc_port, gw.http_port)   # the ports bound (0 asks for free ones)
        ...                                 # serve until done; leaving the block stops both front ends

``GatewayServer(...).start()`` returns the started server; ``.stop(grace_s=1.0)`` ends it (streams still open
after the grace are cancelled, which tells the backend to free their KV).

What a client gets:
- gRPC (``mooncake_jax/proto/gateway.proto``): ``Generate`` takes token ids or text, streams one message per
  token (id, text piece when the prompt was text, index, time since arrival, and its logprob with top
  alternatives when asked) and a summary (finish reason, TTFT, TBT, prompt / output / cached token counts); the
  sampling fields of the HTTP API (top_k, min_p, penalties, logit_bias, logprobs, prompt_logprobs); ``ListModels``;
  the standard health service and reflection.
- HTTP (Starlette on uvicorn): ``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI's format,
  the chat prompt rendered by the model's chat template; ``"stream": true`` for server-sent events ending in
  ``data: [DONE]``), ``GET /v1/models`` (the model id: ``model_name``, by default the preset's or the model
  folder's name), ``GET /metrics`` (Prometheus, vLLM's series names under ``mooncake_``), ``GET /health`` (503
  naming what is missing when the backend cannot serve; the gRPC health service follows it).
- Errors: a bad request is INVALID_ARGUMENT / 400 with a message saying what is wrong; overload is
  RESOURCE_EXHAUSTED / 429 with a retry hint (trailing metadata ``retry-after-s`` / header ``Retry-After``)
  and what refused it (metadata ``rejected-stage`` and ``rejected-cause`` / the body's ``error.stage`` and
  ``error.cause``: ``early`` and the Conductor's reason, or ``late`` and the refusing instance);
  a backend that cannot serve is UNAVAILABLE / 503; a missing token is UNAUTHENTICATED / 401.

Modules, one job each: ``backend`` (the contract), ``tokenizer`` (tokenizer.json or bytes, special tokens and
EOS ids of the model folder, incremental decoding), ``chat`` (chat templates in a Jinja sandbox), ``validate``
(request rules), ``stream`` (one request's events: timing, text, stop strings), ``metrics``, ``auth``, ``core``
(what both front ends share), ``grpc_server``, ``openai_format`` (pydantic request models, response shapes),
``http_server``, ``server`` (``GatewayServer``).
"""

from mooncake_jax.gateway.backend import (Backend, Finished, GenerateRequest, InvalidRequest, Rejected, TokenOut,
                                          Unavailable)
from mooncake_jax.gateway.server import GatewayServer
from mooncake_jax.gateway.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, tokenizer_for

__all__ = ["Backend", "ByteTokenizer", "Finished", "GatewayServer", "GenerateRequest", "HFTokenizer",
           "InvalidRequest", "Rejected", "TokenOut", "Tokenizer", "Unavailable", "tokenizer_for"]
