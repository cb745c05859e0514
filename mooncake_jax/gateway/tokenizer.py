"""Text <-> token ids for the gateway: the checkpoint's ``tokenizer.json``, or bytes for presets.

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

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, with the BOS token when the model uses one."""
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

    def encode(self, text: str) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

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
    does). Special token ids come from the checkpoint's config files when they name them."""

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
        self.bos_token_id, self.eos_token_id = _special_ids(file.parent, self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self) -> "WindowDetokenizer":
        return WindowDetokenizer(self.decode)


def _special_ids(folder: Path, tok) -> tuple[int | None, int | None]:
    """BOS / EOS ids named by tokenizer_config.json (or config.json), as ids of the tokenizer."""
    ids: dict[str, int | None] = {"bos": None, "eos": None}
    for name in ("config.json", "tokenizer_config.json"):  # the later file wins
        try:
            cfg = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        for kind in ids:
            value = cfg.get(f"{kind}_token_id", cfg.get(f"{kind}_token"))
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, str):
                value = tok.token_to_id(value)
            if isinstance(value, int):
                ids[kind] = value
    return ids["bos"], ids["eos"]


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


def tokenizer_for(model: str | Path, vocab_size: int) -> Tokenizer:
    """The tokenizer of ``model``: its folder's tokenizer.json when it has one, else bytes (presets, and
    checkpoints shipping only a SentencePiece model, with a warning for those)."""
    folder = Path(model)
    if folder.is_dir():
        if (folder / "tokenizer.json").is_file():
            return HFTokenizer(folder, vocab_size)
        log.warning("%s has no tokenizer.json: text prompts use the byte tokenizer", folder)
    return ByteTokenizer(vocab_size)
