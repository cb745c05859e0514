"""What both front ends share: the backend, the tokenizer, the model's name, the metrics, and the one path
from parsed request to event stream, so a request is validated, counted and streamed the same way over gRPC
and HTTP."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from mooncake_jax.gateway import stream
from mooncake_jax.gateway.backend import Backend, InvalidRequest, Rejected
from mooncake_jax.gateway.metrics import GatewayMetrics
from mooncake_jax.gateway.tokenizer import Tokenizer
from mooncake_jax.gateway.validate import Params, prepare

log = logging.getLogger(__name__)


def default_model_name(model) -> str:
    """The id a gateway serves ``model`` under when not given one (``--served-model-name``): a preset's name, or
    a model folder's own name (``/models/Llama-3-8B/`` -> ``Llama-3-8B``): clients see no local path."""
    text = str(model)
    path = Path(text).expanduser()
    if not (path.is_dir() or "/" in text or "\\" in text):
        return text  # a preset
    return path.resolve().name or text


@dataclasses.dataclass
class GatewayCore:
    backend: Backend
    tokenizer: Tokenizer
    model_name: str
    metrics: GatewayMetrics

    def check_model(self, name: str | None) -> None:
        """A request may name the model; it must be this one."""
        if name and name != self.model_name:
            raise InvalidRequest(f"unknown model {name!r}; this gateway serves {self.model_name!r}")

    def health(self) -> str | None:
        """None when the backend can serve, else what is missing (its ``health()``; a backend without one is
        taken to be ready). Blocking: a cluster backend asks its Conductor."""
        check = getattr(self.backend, "health", None)
        if check is None:
            return None
        try:
            return check()
        except Exception as e:  # noqa: BLE001 - a failing check means the backend cannot be trusted to serve
            log.warning("backend health check failed: %s", e)
            return f"the backend's health check failed: {e}"

    def generate(self, api: str, parse: Callable[[], Params], *, arrival: float, cancelled: threading.Event,
                 always_text: bool, feed=None, emit=None) -> tuple[str, Iterator[stream.TokenEvent | stream.Summary]]:
        """Validate (``parse`` raises ``InvalidRequest`` for the wire format's own problems) and return the
        request id and its event stream. Token events carry text when ``always_text`` or the prompt came as
        text. ``feed`` and ``emit``: see ``stream.run``."""
        try:
            prepared = prepare(parse(), self.backend, self.tokenizer)
        except InvalidRequest:
            self.metrics.finished(api, "invalid")
            raise
        return prepared.request.request_id, stream.run(self.backend, prepared, self.tokenizer, arrival=arrival,
                                                       cancelled=cancelled, metrics=self.metrics, api=api,
                                                       want_text=always_text or prepared.text_prompt, feed=feed,
                                                       emit=emit)


def retry_hint_s(rejected: Rejected) -> float:
    """The wait a rejected client is told, kept sane whatever the backend said (at least 0.1 s, at most an hour)."""
    hint = rejected.retry_after_s
    return min(max(float(hint), 0.1), 3600.0) if isinstance(hint, (int, float)) and math.isfinite(hint) else 1.0
