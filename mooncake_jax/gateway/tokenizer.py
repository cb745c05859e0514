"""Text <-> token ids for the gateway: the checkpoint's ``tokenizer.json``, or bytes for presets.

A checkpoint folder must hold a ``tokenizer.json`` (the ``tokenizers`` library reads only that format): one
with only a SentencePiece model (``tokenizer.model``) is refused at start rather than silently served with the
byte tokenizer, whose ids would mean nothing to that model; ``tokenizer_for(..., "bytes")`` asks for bytes
explicitly. Besides ``tokenizer.json`` the folder's ``tokenizer_config.json`` (BOS / EOS, ``add_bos_token``, the
chat template), ``config.json`` and ``generation_config.json`` are read: an instruct model often ends a turn
with one of several ids (Llama-3's ``<|eot_id|>`` beside ``<|end_of_text|>``), named in different files, so
``eos_token_ids`` is every EOS id any of them names, and the gateway asks the backend to stop on all of them.

Presets have dummy weights and no vocabulary, so text maps to bytes: token = byte value + ``BYTE_OFFSET``, below
which sit PAD, BOS and EOS (0, 1, 2). That is exactly the layout of LLaMA-2's byte-fallback tokens (``<0x00>`` is
id 3), so the byte tokenizer also produces valid, if long, input for a LLaMA-2 checkpoint without tokenizer.json.

Streaming needs incremental decoding: a token may end in the middle of a UTF-8 character (or of a multi-token
word piece), so each stream gets a ``Detokenizer`` that returns only text that can no longer change, reports
whether it is holding some back, and hands out the rest at the end. The pieces concatenate to ``decode`` of all
the tokens.
"""

from __future__ import annotations

import codecs
import json
import logging
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3


class Detokenizer(Protocol):
    pending: bool  # some text is held back (an incomplete character)

    def add(self, token: int) -> str:
        """The text that became final with this token (often all of it, sometimes none)."""
        ...

    def flush(self) -> str:
        """Whatever is still held back, at the end of the stream."""
        ...


class Tokenizer(Protocol):
    name: str  # "byte" or the tokenizer.json path, for ListModels
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends a generation (eos_token_id among them)
    bos_token: str | None  # the BOS token's text (a chat template emits it), None when it has none
    eos_token: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, with the BOS token when the model uses one and ``add_special_tokens``."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids; special tokens are left out."""
        ...

    def detokenizer(self) -> Detokenizer: ...


class ByteTokenizer:
    """One token per UTF-8 byte; ids below ``BYTE_OFFSET`` and above the byte range decode to nothing."""

    name = "byte"

    def __init__(self, vocab_size: int = 512, bos_token_id: int | None = BOS_ID, eos_token_id: int | None = EOS_ID):
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"the byte tokenizer needs a vocabulary of at least {BYTE_OFFSET + 256} ids, "
                             f"the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids = () if eos_token_id is None else (eos_token_id,)
        self.bos_token = self.eos_token = None  # no text spells them

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return ids if self.bos_token_id is None or not add_special_tokens else [self.bos_token_id, *ids]

    def decode(self, ids: list[int]) -> str:
        return _bytes_of(ids).decode("utf-8", errors="replace")

    def detokenizer(self) -> "ByteDetokenizer":
        return ByteDetokenizer()


def _bytes_of(ids) -> bytes:
    return bytes(t - BYTE_OFFSET for t in ids if BYTE_OFFSET <= t < BYTE_OFFSET + 256)


class ByteDetokenizer:
    """Python's incremental UTF-8 decoder: it holds the bytes of an unfinished character, replaces invalid ones
    exactly as a one-shot ``decode(errors="replace")`` does."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = False

    def add(self, token: int) -> str:
        text = self._decoder.decode(_bytes_of([token]))
        self.pending = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        self.pending = False
        return self._decoder.decode(b"", final=True)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library; its post-processor adds BOS if the model's
    does). Special tokens come from the folder's config files (``ModelFiles``)."""

    def __init__(self, path: str | Path, vocab_size: int | None = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("reading tokenizer.json needs the 'tokenizers' package (pip install tokenizers)") from e
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        self.name = str(file)
        self._tok = _Tokenizer.from_file(str(file))
        self.vocab_size = vocab_size or self._tok.get_vocab_size(with_added_tokens=True)
        files = ModelFiles(file.parent)
        self.bos_token, self.eos_token = files.token_text("bos"), files.token_text("eos")
        self.bos_token_id = files.token_id("bos", self._tok)
        self.eos_token_ids = files.eos_ids(self._tok)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self._add_bos = files.add_bos_token()
        self.chat_template = files.chat_template()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_token_id is not None:
            has_bos = bool(ids) and ids[0] == self.bos_token_id
            if self._add_bos is True and not has_bos:
                ids = [self.bos_token_id, *ids]  # the config asks for BOS; this tokenizer.json's template lacks it
            elif self._add_bos is False and has_bos:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self) -> "Detokenizer":
        if _DecodeStream is not None:
            return StreamDetokenizer(self._tok, self.decode)
        return WindowDetokenizer(self.decode)


try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - depends on the installed version
    _DecodeStream = None


class StreamDetokenizer:
    """``tokenizers``' own streaming decoder (it keeps the context a piece needs, e.g. SentencePiece's leading
    space, and holds an unfinished UTF-8 character). It has no end-of-stream call, so the ids are kept and
    ``flush`` returns what a one-shot decode has beyond the streamed text (a truncated last character)."""

    def __init__(self, tok, decode):
        self._tok, self._decode = tok, decode
        self._stream = _DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self.pending = False

    def add(self, token: int) -> str:
        self._ids.append(token)
        try:
            piece = self._stream.step(self._tok, token)
        except Exception:  # noqa: BLE001 - an id the tokenizer does not know: it decodes to nothing, as decode()
            piece = None
        self.pending = piece is None and self._decode([token]) != ""  # held back, not a skipped special token
        if piece:
            self._emitted.append(piece)
        return piece or ""

    def flush(self) -> str:
        self.pending = False
        full, done = self._decode(self._ids), "".join(self._emitted)
        return full[len(done):] if full.startswith(done) else ""


class ModelFiles:
    """What a checkpoint folder's JSON files say about tokens: ``tokenizer_config.json``, ``config.json``,
    ``generation_config.json`` (each optional; an unreadable one counts as absent)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.configs = {name: _read_json(folder / name) for name in ("config.json", "generation_config.json",
                                                                      "tokenizer_config.json")}

    def token_text(self, kind: str) -> str | None:
        value = self.configs["tokenizer_config.json"].get(f"{kind}_token")
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) and value else None

    def token_id(self, kind: str, tok) -> int | None:
        """``kind`` ("bos"/"eos")'s id: tokenizer_config.json's token text, else the configs' ``*_token_id``."""
        text = self.token_text(kind)
        if text is not None and tok.token_to_id(text) is not None:
            return tok.token_to_id(text)
        for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
            ids = _ids(self.configs[name].get(f"{kind}_token_id"))
            if ids:
                return ids[0]
        return None

    def eos_ids(self, tok) -> tuple[int, ...]:
        """Every EOS id any file names, in order of first mention (tokenizer_config.json's token first)."""
        found: list[int] = []
        first = self.token_id("eos", tok)
        for value in ([first] if first is not None else []) + [
                i for name in ("generation_config.json", "config.json")
                for i in _ids(self.configs[name].get("eos_token_id"))]:
            if value not in found:
                found.append(value)
        return tuple(found)

    def add_bos_token(self) -> bool | None:
        value = self.configs["tokenizer_config.json"].get("add_bos_token")
        return value if isinstance(value, bool) else None

    def chat_template(self) -> str | None:
        """tokenizer_config.json's ``chat_template`` (a string, or the entry named "default" of a list of named
        templates), else ``chat_template.jinja``."""
        value = self.configs["tokenizer_config.json"].get("chat_template")
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default")
        if isinstance(value, str) and value.strip():
            return value
        file = self.folder / "chat_template.jinja"
        if file.is_file():
            return file.read_text()
        return None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _ids(value) -> list[int]:
    """An ``eos_token_id`` field: an id, a list of ids, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class WindowDetokenizer:
    """Incremental decoding for tokenizers whose pieces only make sense in context (SentencePiece's leading
    spaces, byte-level BPE's split characters): decode a short window of recent tokens twice, without and with
    the new one, and emit the difference once it does not end in an unfinished character (the method of
    Hugging Face's text-generation-inference)."""

    def __init__(self, decode):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been emitted
        self.pending = False

    def add(self, token: int) -> str:
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith("\ufffd"):
            self.pending = True
            return ""
        self.pending = False
        if len(after) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        self.pending = False
        return after[len(before):]


BYTES = "bytes"


def tokenizer_for(model: str | Path, vocab_size: int, kind: str | None = None) -> Tokenizer:
    """The tokenizer of ``model``: its folder's tokenizer.json; bytes for a preset name (no vocabulary); a folder
    without tokenizer.json is a ValueError unless ``kind`` is "bytes" (then bytes whatever the model).
    ``kind`` may also be a folder or tokenizer.json path to use instead of the model's."""
    if check_tokenizer_source(model, kind):
        return HFTokenizer(Path(model if kind is None else kind), vocab_size)
    return ByteTokenizer(vocab_size)


def check_tokenizer_source(model: str | Path, kind: str | None = None) -> bool:
    """Whether ``tokenizer_for(model, ..., kind)`` will read a tokenizer.json (True) or use bytes (False); a
    ValueError saying what to do for a model folder without one (cheap: ``serve`` asks before it starts
    instances)."""
    if kind == BYTES:
        return False
    if kind is not None:
        if not Path(kind).exists():
            raise ValueError(f"tokenizer {kind!r}: no such file or folder (give a folder with tokenizer.json, "
                             f"a tokenizer.json file, or 'bytes')")
        model = kind
    folder = Path(model)
    if folder.is_file() and folder.name.endswith(".json"):
        return True
    if folder.is_dir():
        if (folder / "tokenizer.json").is_file():
            return True
        others = sorted(p.name for p in folder.glob("*tokenizer*")) + sorted(p.name for p in folder.glob("*.model"))
        raise ValueError(f"{folder} has no tokenizer.json" + (f" (only {', '.join(dict.fromkeys(others))})"
                                                              if others else "")
                         + ": convert the tokenizer to tokenizer.json (transformers' AutoTokenizer.from_pretrained"
                           "(folder).save_pretrained(folder) writes one), or pass --tokenizer bytes to serve text "
                           "as raw bytes")
    return False
