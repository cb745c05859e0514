"""Chat messages -> prompt text, by the model's own chat template (Jinja, as Hugging Face's ``apply_chat_template``).

The template comes from ``--chat-template`` (a file) or the model folder (tokenizer_config.json's
``chat_template``, or ``chat_template.jinja``). A template is code shipped with a downloaded checkpoint, so it
runs in Jinja's immutable sandbox: it can read the messages and call the few helpers templates use
(``raise_exception``, ``strftime_now``), nothing else; a template error is the request's 400, not a 500.

No doubled BOS: most templates write the BOS token's text themselves; tokenizing that text with special tokens
added would put a second BOS in front, so ``ChatTemplate.render`` reports whether the rendered text already
starts with BOS and the caller then tokenizes without adding special tokens.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from mooncake_jax.gateway.backend import InvalidRequest


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None,
                 origin: str = "chat template"):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.origin = origin
        self.bos_token, self.eos_token = bos_token, eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{origin} is not a valid Jinja template: {e}") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               extra: dict | None = None) -> tuple[str, bool]:
        """``(prompt text, it already starts with the BOS token)``; InvalidRequest when the template refuses the
        conversation (``raise_exception``, e.g. roles not alternating) or fails on it."""
        import jinja2

        context = {**(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        try:
            text = self._template.render(**context)
        except TemplateRefusal as e:
            raise InvalidRequest(f"the chat template refused the messages: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequest(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        return text, bool(self.bos_token) and text.startswith(self.bos_token)


class TemplateRefusal(Exception):
    pass


def _raise(message):
    raise TemplateRefusal(str(message))


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def load_chat_template(tokenizer, override: str | Path | None) -> ChatTemplate | None:
    """The chat template to serve: the ``override`` file when given, else the tokenizer's (from the model
    folder), else None (then /v1/chat/completions answers 400)."""
    bos, eos = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise ValueError(f"chat template {str(path)!r}: no such file")
        return ChatTemplate(path.read_text(), bos_token=bos, eos_token=eos, origin=str(path))
    source = getattr(tokenizer, "chat_template", None)
    if source:
        return ChatTemplate(source, bos_token=bos, eos_token=eos, origin=f"the chat template of {tokenizer.name}")
    return None
