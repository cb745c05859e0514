"""Tokenizers and the text side of streaming: byte tokenizer, tokenizer.json, incremental decoding, stop strings."""

from __future__ import annotations

import json
import random

import pytest

from mooncake_jax.gateway.stream import StopMatcher
from mooncake_jax.gateway.tokenizer import (BOS_ID, BYTE_OFFSET, ByteTokenizer, HFTokenizer, tokenizer_for)

SAMPLES = ["hello", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀 and ascii", "a\x00b\nc"]


def stream_text(tokenizer, ids) -> tuple[list[str], str]:
    """The pieces an incremental detokenizer emits for ``ids`` (flush last) and their concatenation."""
    detok = tokenizer.detokenizer()
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    return pieces, "".join(pieces)


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer(512)
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and len(ids) == len(text.encode()) + 1
    assert all(BYTE_OFFSET <= t < BYTE_OFFSET + 256 for t in ids[1:])
    assert tok.decode(ids) == text
    assert stream_text(tok, ids)[1] == text


def test_byte_tokens_of_a_multibyte_character_wait_for_its_last_byte():
    tok = ByteTokenizer(512)
    detok = tok.detokenizer()
    first, second = tok.encode("é")[1:]
    assert detok.add(first) == "" and detok.pending
    assert detok.add(second) == "é" and not detok.pending


def test_byte_stream_of_any_bytes_never_crashes_and_concatenates_to_the_decode():
    tok = ByteTokenizer(512)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(0, 512) for _ in range(rng.randrange(1, 40))]  # specials, bytes, out-of-byte ids
        pieces, joined = stream_text(tok, ids)
        assert joined == tok.decode(ids)
    # a truncated character at the end comes out as a replacement character on flush
    assert stream_text(tok, tok.encode("🙂")[1:3])[1] == "\ufffd"


def test_byte_tokenizer_needs_room_for_all_bytes():
    ByteTokenizer(BYTE_OFFSET + 256)
    with pytest.raises(ValueError, match="at least 259"):
        ByteTokenizer(258)


def _write_tokenizer_json(folder):
    """A small byte-level BPE tokenizer.json (with a BOS added by its post-processor), trained on the spot."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


@pytest.mark.parametrize("text", SAMPLES + ["the quick brown fox", "  leading and trailing  "])
def test_tokenizer_json_round_trip_and_streaming(tmp_path, text):
    tok = tokenizer_for(_write_tokenizer_json(tmp_path), vocab_size=512)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    ids = tok.encode(text)
    assert ids[0] == 1, "the post-processor's BOS"
    assert tok.decode(ids) == text
    pieces, joined = stream_text(tok, ids)
    assert joined == text
    assert "\ufffd" not in "".join(pieces), "no piece ends inside a character"


def test_presets_use_bytes_and_a_folder_without_tokenizer_json_is_refused(tmp_path):
    assert isinstance(tokenizer_for("tiny", 512), ByteTokenizer)
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")  # a SentencePiece-only checkpoint
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no tokenizer.json \\(only tokenizer.model\\).*--tokenizer bytes"):
        tokenizer_for(tmp_path, 512)
    assert isinstance(tokenizer_for(tmp_path, 512, "bytes"), ByteTokenizer), "bytes only when asked for"


def feed_all(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = []
    for p in pieces:
        released, stopped = m.feed(p)
        out.append(released)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_stop_matcher_holds_back_what_may_become_a_stop_string():
    out, stopped = feed_all(["END"], ["abc", "E", "N", "x"])
    assert out == ["abc", "", "", "ENx", ""] and not stopped
    out, stopped = feed_all(["END"], ["abc", "E", "N", "Dtail"])
    assert out == ["abc", "", "", ""] and stopped
    out, stopped = feed_all(["\n\n", "###"], ["one\n", "two\n", "\nthree"])
    assert "".join(out) == "one\ntwo" and stopped
    out, stopped = feed_all(["b", "abc"], ["xab"])  # the earliest occurrence wins
    assert out == ["xa"] and stopped


def test_gateway_uses_the_checkpoint_tokenizer_json(tmp_path):
    """A backend whose model is a folder with tokenizer.json: prompts are encoded and streams decoded with it."""
    from test_gateway_support import FakeBackend, call_http, sse_events

    from mooncake_jax.gateway import GatewayServer

    folder = _write_tokenizer_json(tmp_path)
    tok = HFTokenizer(folder)
    backend = FakeBackend()
    backend.model_name = str(folder)
    reply = "the lazy dog jumps over the quick brown fox 🙂"
    backend.reply = tok.encode(reply)[1:]
    with GatewayServer(backend, grpc_port=None, model_name="tiny-hf") as gw:
        status, _, text = call_http(gw.http_port, "POST", "/v1/completions",
                                    {"model": "tiny-hf", "prompt": "héllo wörld", "max_tokens": len(backend.reply),
                                     "stream": True})
    assert status == 200
    assert backend.requests[-1].prompt == tok.encode("héllo wörld")
    events = sse_events(text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == reply
