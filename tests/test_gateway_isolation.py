"""Failures stay with their own request: concurrent streams on both front ends are untouched by bad requests,
overload answers and a client vanishing mid-stream; stopping the gateway cancels what is still open."""

from __future__ import annotations

import http.client
import threading

import grpc
import pytest
from test_gateway_support import (WAIT_S, FakeBackend, call_http, generate, grpc_channel, messages, open_request,
                                  read_events, services, sse_events, wait_for)

from mooncake_jax.gateway import GatewayServer, Rejected

VANISHING = 99  # prompts holding this token pause after one token (the client that goes away)
OVERLOADED = 98  # prompts holding this token are rejected


def test_bad_input_and_a_vanishing_client_leave_other_streams_alone():
    backend = FakeBackend()
    backend.token_delay_s = 0.002
    backend.pause_after = 1
    backend.pause_when = lambda request: VANISHING in request.prompt
    backend.fail = Rejected("busy", retry_after_s=1)
    backend.fail_when = lambda request: OVERLOADED in request.prompt
    results = {}
    with GatewayServer(backend) as gw:

        def http_stream():
            status, _, text = call_http(gw.http_port, "POST", "/v1/completions",
                                        {"prompt": [1, 5, 6, 7], "max_tokens": 30, "stream": True})
            results["http"] = status, sse_events(text)

        def grpc_stream():
            results["grpc"] = generate(gw.grpc_port, prompt_token_ids=[1, 8, 9], max_tokens=30)

        threads = [threading.Thread(target=f) for f in (http_stream, grpc_stream)]
        for t in threads:
            t.start()
        sock = open_request(gw.http_port, {"prompt": [1, VANISHING], "max_tokens": 30, "stream": True})
        read_events(sock, 1)
        sock.close()
        for _ in range(3):
            assert call_http(gw.http_port, "POST", "/v1/completions", raw=b"{broken")[0] == 400
            assert call_http(gw.http_port, "POST", "/v1/completions", {"prompt": [1, 5], "max_tokens": -1})[0] == 400
            assert call_http(gw.http_port, "POST", "/v1/completions", {"prompt": [1, OVERLOADED]})[0] == 429
            for fields, code in [({"prompt_text": ""}, grpc.StatusCode.INVALID_ARGUMENT),
                                 ({"prompt_token_ids": [1, OVERLOADED]}, grpc.StatusCode.RESOURCE_EXHAUSTED)]:
                try:
                    generate(gw.grpc_port, **fields)
                    raise AssertionError("no error")
                except grpc.RpcError as e:
                    assert e.code() == code
        for t in threads:
            t.join(WAIT_S)
        assert wait_for(backend.aborted.is_set)
    status, events = results["http"]
    assert status == 200 and events[-1] == "[DONE]"
    assert [e["choices"][0]["token_ids"] for e in events[:-2]] == [[t] for t in [5, 6, 7] * 10]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    tokens = [r.token.token_id for r in results["grpc"][:-1]]
    assert tokens == [8, 9] * 15 and results["grpc"][-1].summary.output_tokens == 30


def test_stop_cancels_open_streams_on_both_front_ends():
    backend = FakeBackend()
    backend.pause_after = 1
    gw = GatewayServer(backend).start()
    channel = grpc_channel(gw.grpc_port)
    call = services.GatewayStub(channel).Generate(messages.GenerateRequest(prompt_token_ids=[1, 5], max_tokens=9),
                                                  timeout=WAIT_S)
    assert next(call).token.token_id == 5
    sock = open_request(gw.http_port, {"prompt": [1, 6], "max_tokens": 9, "stream": True})
    read_events(sock, 1)
    assert len(backend.cancel_events) == 2 and not any(e.is_set() for e in backend.cancel_events)
    idle = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=WAIT_S)
    idle.request("GET", "/health")
    assert idle.getresponse().read() and backend.cancel_events
    gw.stop(grace_s=0.1)
    assert wait_for(lambda: all(e.is_set() for e in backend.cancel_events))
    sock.close()
    channel.close()
    with pytest.raises((http.client.HTTPException, OSError)):  # the kept-alive connection was closed too
        idle.request("GET", "/health")
        idle.getresponse()
    idle.close()
