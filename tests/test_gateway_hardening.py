"""Hostile and odd input against the gateway (fake backend): lone surrogates, deep nesting, a duplicate request id
(409 / ALREADY_EXISTS), a corrupt protobuf, a fuzz of random and mutated bodies on both front ends (every answer a
well-formed 4xx or 200, and a normal request still served after); ``X-Request-Id`` honoured and echoed; CORS."""

from __future__ import annotations

import http.client
import json
import random
import time

import grpc
import pytest
from test_gateway_support import (FakeBackend, call_http, generate, grpc_channel, messages)  # noqa: F401

from mooncake_jax.gateway import GatewayServer
from mooncake_jax.gateway.backend import DuplicateRequest

FUZZ_HTTP, FUZZ_GRPC, FUZZ_BUDGET_S = 1500, 1500, 12.0


@pytest.fixture(scope="module")
def backend():
    return FakeBackend()


@pytest.fixture(scope="module")
def gateway(backend):
    with GatewayServer(backend, cors_origins=("https://app.example",)) as gw:
        yield gw


@pytest.fixture(autouse=True)
def _fresh(backend):
    backend.reset()


def complete(port, raw: bytes, headers=None):
    return call_http(port, "POST", "/v1/completions", raw=raw, headers=headers)


GOOD = {"model": "fake-model", "prompt": [1, 5, 9], "max_tokens": 3}


def test_lone_surrogate_and_deep_nesting_are_400(gateway, caplog):
    for raw in (b'{"model": "fake-model", "prompt": "a\\ud800b", "max_tokens": 2}',
                b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
                b"[" * 100_000 + b"]" * 100_000):
        status, _, body = complete(gateway.http_port, raw)
        assert status == 400 and body["error"]["message"], raw[:40]
    assert not [r for r in caplog.records if r.exc_info]  # no tracebacks logged
    # gRPC: a string field holding a UTF-16 surrogate encoded as UTF-8 bytes (what a lax client would send)
    number = messages.GenerateRequest.DESCRIPTOR.fields_by_name["prompt_text"].number
    raw = bytes([number << 3 | 2, 5]) + b"a\xed\xa0\x80b"
    with grpc_channel(gateway.grpc_port) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(channel.unary_stream("/mooncake.v1.Gateway/Generate")(raw, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_duplicate_request_id_is_409_and_already_exists(gateway, backend):
    backend.fail = DuplicateRequest("request 'r1' is already in flight")
    status, headers, body = complete(gateway.http_port, json.dumps(GOOD).encode(), {"X-Request-Id": "r1"})
    assert status == 409 and "already in flight" in body["error"]["message"] and headers["X-Request-Id"] == "r1"
    with pytest.raises(grpc.RpcError) as err:
        generate(gateway.grpc_port, prompt_token_ids=[1, 5], request_id="r1")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_x_request_id_is_honoured_and_echoed(gateway, backend):
    status, headers, body = complete(gateway.http_port, json.dumps(GOOD).encode(), {"X-Request-Id": "abc-123.x"})
    assert status == 200 and headers["X-Request-Id"] == "abc-123.x" and body["id"].endswith("abc-123.x")
    assert backend.requests[-1].request_id == "abc-123.x"
    status, headers, _ = complete(gateway.http_port, json.dumps(GOOD).encode())
    assert status == 200 and headers["X-Request-Id"] == backend.requests[-1].request_id  # generated, echoed
    status, _, body = complete(gateway.http_port, json.dumps(GOOD).encode(), {"X-Request-Id": "bad id\t"})
    assert status == 400 and "X-Request-Id" in body["error"]["message"]


def test_cors_preflight_and_headers(gateway):
    origin = {"Origin": "https://app.example"}
    status, headers, _ = call_http(gateway.http_port, "OPTIONS", "/v1/completions", headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    status, headers, _ = complete(gateway.http_port, json.dumps(GOOD).encode(), origin)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    _, headers, _ = complete(gateway.http_port, json.dumps(GOOD).encode(), {"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers


def test_corrupt_protobuf_is_invalid_argument(gateway):
    with grpc_channel(gateway.grpc_port) as channel:
        raw = channel.unary_stream("/mooncake.v1.Gateway/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf" in err.value.details()


# --- fuzz ------------------------------------------------------------------------------------------------------

def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 1, 2**31, 2**63, -2**64, 3, 17, 511, 512, 10**30])
    if kind == 2:
        return rng.choice([0.5, -0.0, 1e308, -1e-308, 2.0, 1e400 if False else 7.25])
    if kind in (3, 4):
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x2FFF), 0xFFFD, 0]))
                       for _ in range(rng.randrange(12)))
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    keys = ["model", "prompt", "max_tokens", "temperature", "top_p", "stream", "stop", "seed", "n", "messages",
            "logprobs", "echo", "stream_options", "ignore_eos", "user", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(6))}


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        op = rng.randrange(4)
        if op == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1 and data:
            del data[rng.randrange(len(data)):rng.randrange(len(data) + 1)]
        elif op == 2:
            i = rng.randrange(len(data) + 1)
            data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        else:
            i = rng.randrange(len(data) + 1)
            data[i:i] = rng.choice([b"{", b"[", b'"', b"\\u", b"\\ud800", b"1e999", b"null", b","])
    return bytes(data)


def test_fuzz_http_and_grpc_bodies_get_well_formed_answers(gateway, backend):
    """A few thousand random and mutated bodies: every answer is a 200 or a 4xx with OpenAI's error shape (HTTP),
    OK or INVALID_ARGUMENT / ALREADY_EXISTS (gRPC); no 5xx, no hang; then a normal request still works."""
    rng = random.Random(13)
    seeds = [json.dumps(GOOD).encode(), json.dumps({**GOOD, "prompt": "hello", "stream": True}).encode(),
             json.dumps({**GOOD, "stop": ["x"], "temperature": 0.5, "top_p": 0.9}).encode()]
    counts: dict = {}
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=10)
    deadline = time.monotonic() + FUZZ_BUDGET_S
    sent_http = 0
    for i in range(FUZZ_HTTP):
        if time.monotonic() > deadline:
            break
        raw = (json.dumps(_random_json(rng)).encode() if i % 2 else _mutate(rng, rng.choice(seeds)))
        path = rng.choice(["/v1/completions", "/v1/completions", "/v1/chat/completions"])
        conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        sent_http += 1
        counts[resp.status] = counts.get(resp.status, 0) + 1
        assert resp.status == 200 or 400 <= resp.status < 500, (resp.status, raw, payload)
        if resp.status != 200:
            assert json.loads(payload)["error"]["message"], payload
        if resp.getheader("Connection", "").lower() == "close":
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=10)
    conn.close()
    good = messages.GenerateRequest(model="fake-model", prompt_token_ids=[1, 5, 9], max_tokens=2,
                                    prompt_text="").SerializeToString()
    codes: dict = {}
    sent_grpc = 0
    with grpc_channel(gateway.grpc_port) as channel:
        raw_generate = channel.unary_stream("/mooncake.v1.Gateway/Generate")
        for i in range(FUZZ_GRPC):
            if time.monotonic() > deadline + FUZZ_BUDGET_S:
                break
            body = _mutate(rng, good) if i % 2 else bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
            try:
                list(raw_generate(body, timeout=10))
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            sent_grpc += 1
            codes[code.name] = codes.get(code.name, 0) + 1
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, body)
    print(f"fuzz: {sent_http} HTTP bodies {counts}; {sent_grpc} gRPC bodies {codes}")
    assert sent_http >= 500 and sent_grpc >= 500  # the budget allows thousands; fewer means something is slow
    assert counts.get(400, 0) > 100 and codes.get("INVALID_ARGUMENT", 0) > 100  # the fuzz reached the checks
    status, _, body = complete(gateway.http_port, json.dumps(GOOD).encode())
    assert status == 200 and body["choices"][0]["token_ids"] == [5, 9, 5]
    assert [r.token.token_id for r in generate(gateway.grpc_port, prompt_token_ids=[1, 5, 9], max_tokens=2)
            if r.HasField("token")] == [5, 9]


def test_token_comes_from_the_flag_a_file_or_the_environment(tmp_path):
    from mooncake_jax.gateway.auth import API_KEY_ENV, resolve_token

    file = tmp_path / "token"
    file.write_text("from-file\nignored\n")
    env = {API_KEY_ENV: " from-env "}
    assert resolve_token(None, None, env) == "from-env"
    assert resolve_token(None, str(file), env) == "from-file"
    assert resolve_token("from-flag", None, env) == "from-flag"
    assert resolve_token(None, None, {}) is None
    for flag, path, message in (("a", str(file), "not both"), (None, str(tmp_path / "none"), "cannot read"),
                                ("  ", None, "must not be empty")):
        with pytest.raises(ValueError, match=message):
            resolve_token(flag, path, env)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_token(None, str(tmp_path / "empty"), env)
