"""The gateway's OpenAI-compatible HTTP front end against the fake backend: completions (plain and SSE), models,
metrics, health, errors, disconnects, auth."""

from __future__ import annotations

import http.client
import json
import statistics
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_support import (WAIT_S, FakeBackend, _fresh_backend, backend, call_http, gateway,  # noqa: F401
                                  generate, open_request, read_events, sse_events, text_ids, wait_for)

from mooncake_jax.gateway import GatewayServer, Rejected, Unavailable
from mooncake_jax.gateway.backend import REJECT_LATE


def complete(port, body, headers=None):
    return call_http(port, "POST", "/v1/completions", body, headers)


def test_non_streaming_completion_of_token_ids(gateway, backend):
    backend.reply = text_ids("Hi!")
    status, headers, body = complete(gateway.http_port, {"model": "fake-model", "prompt": [1, 7, 8],
                                                         "max_tokens": 3, "temperature": 0.7, "seed": 11})
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": "Hi!", "token_ids": text_ids("Hi!"), "logprobs": None,
                      "finish_reason": "length"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert body["timing"]["ttft_s"] > 0
    sent = backend.requests[-1]
    assert (sent.prompt, sent.max_tokens, sent.seed) == ([1, 7, 8], 3, 11)


def test_text_prompt_stop_strings_and_defaults(gateway, backend):
    backend.reply = text_ids("première ligne\nseconde")
    status, _, body = complete(gateway.http_port, {"prompt": "Écris", "max_tokens": 40, "stop": "\n"})
    assert status == 200
    assert body["choices"][0]["text"] == "première ligne"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert backend.requests[-1].prompt == [1, *text_ids("Écris")]
    status, _, body = complete(gateway.http_port, {"prompt": "x"})
    sent = backend.requests[-1]
    assert (sent.max_tokens, sent.temperature, sent.top_p) == (16, 0.0, 1.0), "OpenAI's defaults"
    assert body["choices"][0]["text"] == "première ligne\n", "16 bytes; no stop string this time"


def test_streaming_completion_chunks_and_done(gateway, backend):
    reply = "ça va? 🙂 oui"
    backend.reply = text_ids(reply)
    status, headers, text = complete(gateway.http_port, {"prompt": "q", "max_tokens": len(backend.reply),
                                                         "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    token_chunks, finish, usage = chunks[:-2], chunks[-2], chunks[-1]
    assert len(token_chunks) == len(backend.reply)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in token_chunks:
        assert c["object"] == "text_completion" and c["model"] == "fake-model"
        (choice,) = c["choices"]
        assert choice["finish_reason"] is None and choice["index"] == 0
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == reply
    assert [c["choices"][0]["token_ids"][0] for c in token_chunks] == backend.reply
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["text"] == ""
    assert finish["usage"]["completion_tokens"] == len(backend.reply)
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 2


def test_streaming_with_a_stop_string_and_eos(gateway, backend):
    backend.reply = text_ids("abc<END>def")
    _, _, text = complete(gateway.http_port, {"prompt": [1, 3], "max_tokens": 30, "stream": True,
                                              "stop": ["<END>"]})
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    backend.reply = [*text_ids("ok"), 2, *text_ids("never")]
    _, _, text = complete(gateway.http_port, {"prompt": [1, 3], "max_tokens": 30, "stream": True})
    events = sse_events(text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ok"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


BAD = [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"max_tokens": 3}, "prompt is required"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [1, "a"]}, "list of token ids"),
    ({"prompt": [1, True]}, "list of token ids"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"prompt": ["a", []]}, "prompt 1 must be a string or a non-empty list of token ids"),
    ({"prompt": [1, 600]}, "outside the vocabulary"),
    ({"prompt": "hi", "model": "gpt-3.5-turbo-instruct"}, "unknown model 'gpt-3.5-turbo-instruct'"),
    ({"prompt": "hi", "model": 3}, "model must be a string"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens must be at least 1"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens must be an integer"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens must be an integer"),
    ({"prompt": "x" * 80}, "context is 64"),
    ({"prompt": [1] * 50, "max_tokens": 20}, "exceeds the model's context"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature must be a finite number >= 0"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature must be a finite number"),
    ({"prompt": "hi", "top_p": 2}, "top_p must be in (0, 1]"),
    ({"prompt": "hi", "seed": -1}, "seed must be in"),
    ({"prompt": "hi", "stop": 7}, "stop must be a string or a list of strings"),
    ({"prompt": "hi", "stop": [""]}, "stop strings must not be empty"),
    ({"prompt": "hi", "stream": "yes"}, "stream must be a boolean"),
    ({"prompt": "hi", "n": 0}, "n must be in [1, 64]"),
    ({"prompt": "hi", "n": 2.0}, "n must be an integer"),
    ({"prompt": ["a", "b"], "n": 65}, "n must be in [1, 64]"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1 (0 only with echo)"),
    ({"prompt": "hi", "echo": "yes"}, "echo must be a boolean"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs must be in [0, 20]"),
    ({"prompt": "hi", "best_of": 2}, "best_of=2 is not supported"),
    ({"prompt": "hi", "top_k": -2}, "top_k must be -1 or 0 (off) or a positive integer"),
    ({"prompt": "hi", "top_k": 1.5}, "top_k must be an integer"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
    ({"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]"),
    ({"prompt": "hi", "presence_penalty": -2.5}, "presence_penalty must be in [-2, 2]"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"600": 1}}, "logit_bias token id 600 is outside the vocabulary"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias of token 5 must be a number in [-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"5": "up"}}, "logit_bias of token 5 must be a number"),
    ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage must be a boolean"),
]


@pytest.mark.parametrize("body, message", BAD, ids=range(len(BAD)))
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_400_with_the_reason(gateway, backend, body, message, stream):
    if stream and isinstance(body, dict):
        body = {**body, "stream": body.get("stream", True)}
    raw = body if isinstance(body, bytes) else None
    status, _, answer = call_http(gateway.http_port, "POST", "/v1/completions", None if raw else body, raw=raw)
    assert status == 400, answer
    assert message in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    assert backend.requests == []


def test_keep_alive_connection_survives_a_bad_request(gateway, backend):
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=WAIT_S)
    try:
        for body, expected in [(b"{oops", 400), (json.dumps({"prompt": [1, 5], "max_tokens": 2}).encode(), 200),
                               (b'{"prompt": []}', 400), (json.dumps({"prompt": "ok"}).encode(), 200)]:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == expected
    finally:
        conn.close()


def test_overload_is_429_with_retry_after_and_unavailable_is_503(gateway, backend):
    for stream in (False, True):
        backend.fail = Rejected("prefill queue too long", retry_after_s=2.2, stage="late", cause="prefill-1")
        status, headers, body = complete(gateway.http_port, {"prompt": "hi", "stream": stream})
        assert status == 429 and headers["Retry-After"] == "3"
        assert "prefill queue too long" in body["error"]["message"] and body["error"]["retry_after_s"] == 2.2
        assert (body["error"]["stage"], body["error"]["cause"]) == ("late", "prefill-1")
        backend.fail = Unavailable("no decode instance alive")
        status, _, body = complete(gateway.http_port, {"prompt": "hi", "stream": stream})
        assert status == 503 and "no decode instance alive" in body["error"]["message"]
    backend.fail = Rejected("confused backend", retry_after_s=float("inf"))
    status, headers, body = complete(gateway.http_port, {"prompt": "hi"})
    assert status == 429 and headers["Retry-After"] == "1" and body["error"]["retry_after_s"] == 1.0
    backend.fail = None
    assert complete(gateway.http_port, {"prompt": [1, 5]})[0] == 200


def test_failure_after_the_first_token(gateway, backend):
    backend.fail_after = (2, Unavailable("decode instance lost"))
    status, _, body = complete(gateway.http_port, {"prompt": [1, 5, 6], "max_tokens": 5})
    assert status == 503 and "decode instance lost" in body["error"]["message"]
    _, _, text = complete(gateway.http_port, {"prompt": [1, 5, 6], "max_tokens": 5, "stream": True})
    events = sse_events(text)
    assert [e["choices"][0]["token_ids"] for e in events[:2]] == [[5], [6]]
    assert "decode instance lost" in events[2]["error"]["message"] and events[-1] == "[DONE]"


def test_client_disconnect_mid_stream_sets_cancelled(gateway, backend):
    backend.pause_after = 2
    sock = open_request(gateway.http_port, {"prompt": [1, 5, 6], "max_tokens": 10, "stream": True})
    received = read_events(sock, 2)
    assert b"200 OK" in received and not backend.cancel_events[-1].is_set()
    sock.close()
    assert wait_for(backend.aborted.is_set), "the backend saw the cancellation while waiting for the next token"
    assert not backend.release.is_set()


def test_client_disconnect_while_waiting_for_a_plain_answer_sets_cancelled(gateway, backend):
    backend.pause_after = 0  # nothing comes out until cancelled
    sock = open_request(gateway.http_port, {"prompt": [1, 5, 6], "max_tokens": 10})
    assert wait_for(lambda: backend.requests)
    sock.close()
    assert wait_for(backend.aborted.is_set)
    assert backend.cancel_events[-1].is_set()


def test_models_and_health(gateway):
    status, _, body = call_http(gateway.http_port, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [("fake-model", "model", 64)]
    assert call_http(gateway.http_port, "GET", "/v1/models/fake-model")[2]["id"] == "fake-model"
    assert call_http(gateway.http_port, "GET", "/v1/models/other")[0] == 404
    assert call_http(gateway.http_port, "GET", "/health")[:3:2] == (200, {"status": "ok"})
    assert call_http(gateway.http_port, "GET", "/nope")[0] == 404
    status, _, body = call_http(gateway.http_port, "POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "no chat template" in body["error"]["message"], "the fake model has none"
    assert call_http(gateway.http_port, "GET", "/v1/completions")[0] == 405


def scrape(port) -> dict:
    """``{(name, labels as a sorted tuple): value}`` of /metrics."""
    status, headers, text = call_http(port, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_move(gateway, backend):
    before = scrape(gateway.http_port)
    backend.reply = [40, 41, 42, 43]
    assert complete(gateway.http_port, {"prompt": [1, 5], "max_tokens": 4})[0] == 200
    generate(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=4)
    complete(gateway.http_port, {"prompt": ""})
    backend.fail = Rejected("busy", stage=REJECT_LATE)
    complete(gateway.http_port, {"prompt": "hi"})
    backend.fail = Rejected("busy")
    complete(gateway.http_port, {"prompt": "hi"})
    in_flight = ("mooncake_gateway_requests_in_flight", ())
    assert wait_for(lambda: scrape(gateway.http_port)[in_flight] == 0), "every request has ended"
    after = scrape(gateway.http_port)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("mooncake_time_to_first_token_seconds_count") == 2
    assert delta("mooncake_gateway_tbt_seconds_count") == 2
    assert delta("mooncake_time_to_first_token_seconds_sum") > 0
    assert delta("mooncake_gateway_requests_total", api="http", outcome="length") == 1
    assert delta("mooncake_gateway_requests_total", api="grpc", outcome="length") == 1
    assert delta("mooncake_gateway_requests_total", api="http", outcome="invalid") == 1
    assert delta("mooncake_gateway_requests_total", api="http", outcome="rejected") == 2
    assert delta("mooncake_gateway_rejections_total", stage="late") == 1
    assert delta("mooncake_gateway_rejections_total", stage="early") == 1
    assert delta("mooncake_gateway_tokens_total", kind="output") == 8
    assert delta("mooncake_gateway_tokens_total", kind="prompt") == 4
    assert delta("mooncake_gateway_tokens_total", kind="cached") == 6
    assert after[("mooncake_backend_queue_depth", (("instance", "p0"),))] == 2
    assert after[("mooncake_backend_queue_depth", (("instance", "d0"),))] == 1
    assert after[("mooncake_backend_cache_hit_tokens_total", ())] == 40
    assert after[("mooncake_backend_transfer_bytes_total", ())] == 4096


def test_metrics_survive_a_failing_stats_call():
    class Broken(FakeBackend):
        def stats(self):
            raise RuntimeError("stats exploded")

    with GatewayServer(Broken(), grpc_port=None) as gw:
        samples = scrape(gw.http_port)
    assert ("mooncake_gateway_requests_in_flight", ()) in samples
    assert not any(name.startswith("mooncake_backend_") for name, _ in samples)


def test_token_gates_everything_but_health():
    backend = FakeBackend()
    with GatewayServer(backend, auth_token="s3cret", grpc_port=None) as gw:
        port = gw.http_port
        for headers in [{}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}]:
            for method, path, body in [("POST", "/v1/completions", {"prompt": [1, 5]}), ("GET", "/v1/models", None),
                                       ("GET", "/metrics", None)]:
                status, answer_headers, answer = call_http(port, method, path, body, headers)
                assert status == 401 and answer["error"]["type"] == "authentication_error"
                assert answer_headers["WWW-Authenticate"].startswith("Bearer")
        assert backend.requests == []
        good = {"Authorization": "Bearer s3cret"}
        assert complete(port, {"prompt": [1, 5], "max_tokens": 2}, good)[0] == 200
        assert call_http(port, "GET", "/v1/models", headers=good)[0] == 200
        assert call_http(port, "GET", "/health")[0] == 200


def test_answers_on_a_kept_alive_connection_are_not_held_by_nagle(gateway, backend):
    """Headers and body are separate writes; without TCP_NODELAY each answer waits ~40 ms for a delayed ACK."""
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=WAIT_S)
    latencies = []
    try:
        for stream in [False, True] * 6:
            start = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 5], "stream": stream}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            latencies.append(time.perf_counter() - start)
            assert resp.status == 200
    finally:
        conn.close()
    assert statistics.median(latencies) < 0.02, latencies


def test_a_stream_whose_client_left_before_its_first_chunk_still_ends_its_requests():
    """The body's generator never starts (the first write fails), so only the response can unregister the request
    and cancel its generation."""
    import asyncio

    from starlette.requests import ClientDisconnect

    from mooncake_jax.gateway.http_server import _StreamOf

    started, ended = [], []

    async def body():
        started.append(1)
        yield b"data: {}\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    response = _StreamOf(body(), lambda: ended.append(1))
    with pytest.raises(ClientDisconnect):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert started == [] and ended == [1]
