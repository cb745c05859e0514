"""The HTTP gateway as a user of the official ``openai`` client meets it, over a fake backend and a small model
folder (tokenizer.json, tokenizer_config.json with a chat template, generation_config.json with several EOS ids):
completions and chat, plain and streaming; the chat prompt the backend receives; stopping on every EOS id;
unknown fields, lone surrogates and deep JSON refused with 400; a SentencePiece-only folder refused at start;
/health following the backend; graceful drain; many idle connections, slow heads and the connection cap."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_gateway_support import (WAIT_S, FakeBackend, call_http, grpc_channel, open_request, read_events,
                                  sse_events, wait_for)

from mooncake_jax.gateway import GatewayServer
from mooncake_jax.gateway.tokenizer import ByteTokenizer, HFTokenizer

openai = pytest.importorskip("openai")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A model folder: a byte-level BPE tokenizer.json whose post-processor adds BOS, a chat template, and EOS
    ids spread over three files (</s> in tokenizer_config.json, <|eot|> only in generation_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = tmp_path_factory.mktemp("model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "you are a helpful assistant"] * 20,
                            trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


@pytest.fixture(scope="module")
def tok(folder):
    return HFTokenizer(folder)


@pytest.fixture(scope="module")
def served(folder):
    backend = FakeBackend()
    backend.model_name = str(folder)
    with GatewayServer(backend, grpc_port=0, model_name="tiny-chat") as gw:
        yield gw, backend


@pytest.fixture
def gw(served):
    gw, backend = served
    backend.reset()
    return gw, backend


def client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def test_completions_plain_and_streaming(gw, tok):
    gw, backend = gw
    reply = "the lazy dog"
    backend.reply = tok.encode(reply, add_special_tokens=False)
    c = client(gw.http_port)
    answer = c.completions.create(model="tiny-chat", prompt="the quick brown fox", max_tokens=len(backend.reply))
    assert answer.choices[0].text == reply and answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == len(backend.reply)
    assert backend.requests[-1].prompt == tok.encode("the quick brown fox")
    chunks = list(c.completions.create(model="tiny-chat", prompt="the quick brown fox", stream=True,
                                       max_tokens=len(backend.reply)))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == reply
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_plain_and_streaming_with_a_system_message_and_a_generation_prompt(gw, tok):
    gw, backend = gw
    reply = "you are quick"
    backend.reply = tok.encode(reply, add_special_tokens=False)
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "the quick brown fox"}]
    c = client(gw.http_port)
    answer = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=len(backend.reply))
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == reply
    expected = ("<s><|system|>you are a helpful assistant<|eot|><|user|>the quick brown fox<|eot|>"
                "<|assistant|>")
    sent = backend.requests[-1].prompt
    assert sent == tok.encode(expected, add_special_tokens=False)
    assert sent[0] == 1 and sent.count(1) == 1, "the template's BOS, not a second one from the tokenizer"
    assert sent[-1] == tok._tok.token_to_id("<|assistant|>"), "the generation prompt"
    stream = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=len(backend.reply),
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reply
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(sent)
    assert backend.requests[-1].prompt == sent


def test_chat_without_the_generation_prompt_and_a_template_refusal(gw):
    gw, backend = gw
    c = client(gw.http_port)
    c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                              extra_body={"add_generation_prompt": False})
    assert backend.requests[-1].prompt[-1] == 3, "ends with the message's <|eot|>, no <|assistant|>"
    with pytest.raises(openai.BadRequestError, match="messages must not be empty"):
        c.chat.completions.create(model="tiny-chat", messages=[], max_tokens=1)


def test_every_eos_id_stops(gw, tok, folder):
    gw, backend = gw
    assert tok.eos_token_ids == (2, 3)
    c = client(gw.http_port)
    for eos in (2, 3):
        backend.reply = [*tok.encode("the dog", add_special_tokens=False), eos, *tok.encode("fox", False)]
        answer = c.completions.create(model="tiny-chat", prompt="the", max_tokens=20)
        assert answer.choices[0].text == "the dog" and answer.choices[0].finish_reason == "stop"
        assert set(backend.requests[-1].stop_token_ids) == {2, 3}
    backend.reply = [*tok.encode("the dog", add_special_tokens=False), 3]
    answer = c.completions.create(model="tiny-chat", prompt="the", max_tokens=6, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length" and backend.requests[-1].stop_token_ids == ()


def test_unknown_and_mistyped_fields_are_400_naming_them(gw):
    gw, backend = gw
    c = client(gw.http_port)
    for extra, name in [({"top_kk": 5}, "'top_kk'"), ({"min_tokens": 1}, "'min_tokens'"),
                        ({"stream_options": {"include_usage": True, "x": 1}}, "'stream_options.x'")]:
        with pytest.raises(openai.BadRequestError, match=f"unknown field {name}"):
            c.completions.create(model="tiny-chat", prompt="hi", max_tokens=2, extra_body=extra)
        with pytest.raises(openai.BadRequestError, match=f"unknown field {name}"):
            c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, extra_body=extra)
    status, _, body = call_http(gw.http_port, "POST", "/v1/chat/completions",
                                {"messages": [{"role": 7, "content": "hi"}]})
    assert status == 400 and body["error"]["message"].startswith("messages.0.role must be a string")
    assert backend.requests == []


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "lone surrogate (U+D800 at character 1)"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "lone surrogate (U+DFFF"),
    (b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop string 0 contains a lone surrogate"),
    (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested too deeply"),
    (b"[" * 1000 + b"]" * 1000, "nested too deeply"),
    (b'{"prompt": "hi", "x": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"}", "nested too deeply"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"prompt": "\xff\xfe"}', "malformed JSON"),
])
def test_hostile_bodies_are_400_and_the_server_keeps_serving(gw, raw, message):
    gw, backend = gw
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    status, _, body = call_http(gw.http_port, "POST", path, raw=raw)
    assert status == 400, body
    assert message in body["error"]["message"]
    assert backend.requests == []
    assert client(gw.http_port).completions.create(model="tiny-chat", prompt="ok", max_tokens=1).choices


def test_a_sentencepiece_only_folder_is_refused_at_start(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    backend = FakeBackend()
    backend.model_name = str(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer.json .*--tokenizer bytes"):
        GatewayServer(backend)
    with GatewayServer(backend, tokenizer="bytes") as gw:  # explicit: served as bytes
        assert isinstance(gw.core.tokenizer, ByteTokenizer)


def test_a_missing_chat_template_is_400_unless_given_as_a_file(tmp_path):
    backend = FakeBackend()
    messages = [{"role": "user", "content": "hi"}]
    with GatewayServer(backend, grpc_port=None) as gw:
        with pytest.raises(openai.BadRequestError, match="no chat template.*--chat-template"):
            client(gw.http_port).chat.completions.create(model="fake-model", messages=messages, max_tokens=1)
    file = tmp_path / "t.jinja"
    file.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    with GatewayServer(backend, grpc_port=None, chat_template=file) as gw:
        client(gw.http_port).chat.completions.create(model="fake-model", messages=messages, max_tokens=1)
    assert backend.requests[-1].prompt == ByteTokenizer().encode("[user] hi\n[assistant] ")
    file.write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")  # the sandbox refuses this
    with GatewayServer(backend, grpc_port=None, chat_template=file) as gw:
        with pytest.raises(openai.BadRequestError, match="chat template failed"):
            client(gw.http_port).chat.completions.create(model="fake-model", messages=messages, max_tokens=1)


def test_health_follows_the_backend_on_both_front_ends(gw):
    gw, backend = gw
    with grpc_channel(gw.grpc_port) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert call_http(gw.http_port, "GET", "/health")[0] == 200
        assert check(health_pb2.HealthCheckRequest(), timeout=WAIT_S).status == health_pb2.HealthCheckResponse.SERVING
        backend.unhealthy = "no decode instance alive"
        status, _, body = call_http(gw.http_port, "GET", "/health")
        assert status == 503 and "no decode instance alive" in body["error"]["message"]
        assert (check(health_pb2.HealthCheckRequest(), timeout=WAIT_S).status
                == health_pb2.HealthCheckResponse.NOT_SERVING)
        backend.unhealthy = None
        assert call_http(gw.http_port, "GET", "/health")[0] == 200
        assert check(health_pb2.HealthCheckRequest(), timeout=WAIT_S).status == health_pb2.HealthCheckResponse.SERVING


def read_to_close(sock: socket.socket, received: bytes) -> bytes:
    while data := sock.recv(65536):
        received += data
    return received


def dechunk(raw: bytes) -> str:
    """The body of a complete chunked HTTP answer (it must end with the zero-size chunk)."""
    body, rest = b"", raw.split(b"\r\n\r\n", 1)[1]
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            return body.decode()
        body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]


def test_stop_drains_open_streams_with_an_error_event_and_done():
    backend = FakeBackend()
    backend.pause_after = 1
    backend.pause_when = lambda request: 99 in request.prompt  # the stream still open when the grace ends
    backend.token_delay_s = 0.01
    gw = GatewayServer(backend, grpc_port=None).start()
    stuck = open_request(gw.http_port, {"prompt": [1, 99], "max_tokens": 9, "stream": True})
    finishing = open_request(gw.http_port, {"prompt": [1, 5], "max_tokens": 20, "stream": True})
    stuck_head, finishing_head = read_events(stuck, 1), read_events(finishing, 1)
    stopper = threading.Thread(target=gw.stop, kwargs={"grace_s": 1.0})
    stopper.start()
    finished = sse_events(dechunk(read_to_close(finishing, finishing_head)))
    cut = sse_events(dechunk(read_to_close(stuck, stuck_head)))
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert finished[-1] == "[DONE]" and finished[-2]["choices"][0]["finish_reason"] == "length", "within the grace"
    assert len(finished) == 22
    assert cut[-1] == "[DONE]" and "shutting down" in cut[-2]["error"]["message"]
    assert cut[-2]["error"]["code"] == 503 and cut[0]["choices"][0]["token_ids"] == [99]
    assert wait_for(lambda: all(e.is_set() for e in backend.cancel_events))
    assert wait_for(backend.aborted.is_set), "the backend was told to stop the cut stream"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", gw.http_port), timeout=WAIT_S)


def test_many_idle_connections_do_not_break_a_completion(gw):
    gw, backend = gw
    idle = []
    try:
        for _ in range(1100):  # above select()'s 1,024 descriptors
            idle.append(socket.create_connection(("127.0.0.1", gw.http_port), timeout=WAIT_S))
        c = client(gw.http_port)
        answer = c.completions.create(model="tiny-chat", prompt="the quick brown fox", max_tokens=3)
        assert len(answer.choices[0].text) > 0 and answer.choices[0].finish_reason == "length"
        assert len(list(c.completions.create(model="tiny-chat", prompt="the", max_tokens=3, stream=True))) == 4
        idle[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in idle[0].recv(4096), "the idle connections are live, not refused"
    finally:
        for sock in idle:
            sock.close()


def test_slow_or_silent_clients_are_closed_and_the_cap_refuses_the_excess():
    backend = FakeBackend()
    with GatewayServer(backend, grpc_port=None, http_idle_timeout_s=0.3, http_header_timeout_s=0.3,
                       http_body_timeout_s=0.3, http_max_connections=4) as gw:
        silent = socket.create_connection(("127.0.0.1", gw.http_port), timeout=WAIT_S)
        slow = socket.create_connection(("127.0.0.1", gw.http_port), timeout=WAIT_S)
        slow.sendall(b"POST /v1/comp")  # a head that never ends
        assert silent.recv(1) == b"" and slow.recv(1) == b"", "both closed by their deadline"
        short = socket.create_connection(("127.0.0.1", gw.http_port), timeout=WAIT_S)
        short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        answer = read_to_close(short, b"")
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in answer
        assert backend.requests == []
        held = [socket.create_connection(("127.0.0.1", gw.http_port), timeout=WAIT_S) for _ in range(4)]
        status, headers, body = call_http(gw.http_port, "GET", "/v1/models")
        assert status == 503 and "too many open connections" in body["error"]["message"], "over the cap"
        assert headers["Connection"] == "close" and headers["Retry-After"] == "1"
        held[0].sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in held[0].recv(4096), "the held connections are untouched"
        for sock in held:
            sock.close()
        assert wait_for(lambda: call_http(gw.http_port, "GET", "/v1/models")[0] == 200)
