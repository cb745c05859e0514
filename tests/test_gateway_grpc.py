"""The gateway's gRPC front end against the fake backend: stream contents, errors, cancellation, auth, health,
reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from test_gateway_support import (WAIT_S, FakeBackend, _fresh_backend, backend, gateway, generate,  # noqa: F401
                                  grpc_channel, grpc_error, messages, services, text_ids, wait_for)

from mooncake_jax.gateway import GatewayServer, InvalidRequest, Rejected, Unavailable
from mooncake_jax.gateway.backend import REJECT_LATE


def split(responses):
    """``(token chunks, summary)``; asserts the summary is last and alone."""
    assert responses and all(r.WhichOneof("event") == "token" for r in responses[:-1])
    assert responses[-1].WhichOneof("event") == "summary"
    return [r.token for r in responses[:-1]], responses[-1].summary


def test_token_ids_stream_with_timing_and_summary(gateway, backend):
    tokens, summary = split(generate(gateway.grpc_port, prompt_token_ids=[1, 10, 11, 12], max_tokens=5,
                                     temperature=0.5, top_p=0.9, seed=7, request_id="r-1"))
    assert [t.token_id for t in tokens] == [10, 11, 12, 10, 11]
    assert [t.index for t in tokens] == list(range(5))
    assert all(t.text == "" for t in tokens), "no text for a token-id prompt"
    times = [t.time_s for t in tokens]
    assert times == sorted(times) and times[0] > 0
    assert summary.finish_reason == messages.FINISH_REASON_LENGTH
    assert (summary.prompt_tokens, summary.output_tokens, summary.cached_tokens) == (4, 5, 3)
    assert summary.ttft_s == pytest.approx(times[0]) and summary.total_s >= times[-1]
    assert summary.tbt_s >= 0 and summary.request_id == "r-1"
    sent = backend.requests[-1]
    assert (sent.prompt, sent.max_tokens, sent.seed, sent.request_id) == ([1, 10, 11, 12], 5, 7, "r-1")
    assert sent.temperature == pytest.approx(0.5) and sent.top_p == pytest.approx(0.9)


def test_text_prompt_round_trips_through_the_byte_tokenizer(gateway, backend):
    reply = "héllo, wörld 🙂"
    backend.reply = text_ids(reply)
    tokens, summary = split(generate(gateway.grpc_port, prompt_text="Grüße", max_tokens=len(backend.reply)))
    assert backend.requests[-1].prompt == [1, *text_ids("Grüße")]
    assert "".join(t.text for t in tokens) == reply
    assert [t.token_id for t in tokens] == backend.reply
    assert summary.output_tokens == len(backend.reply)


def test_eos_and_stop_token_ids_end_with_stop(gateway, backend):
    backend.reply = [50, 60, 2, 70]
    tokens, summary = split(generate(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=10))
    assert [t.token_id for t in tokens] == [50, 60, 2]
    assert summary.finish_reason == messages.FINISH_REASON_STOP
    tokens, summary = split(generate(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=10, ignore_eos=True,
                                     stop_token_ids=[70]))
    assert [t.token_id for t in tokens] == [50, 60, 2, 70]
    assert backend.requests[-1].stop_token_ids == (70,) and backend.requests[-1].ignore_eos


def test_stop_string_truncates_the_text_and_cancels_the_backend(gateway, backend):
    backend.reply = text_ids("one two STOP three")
    tokens, summary = split(generate(gateway.grpc_port, prompt_text="count", max_tokens=30, stop=["STOP", "zzz"]))
    assert "".join(t.text for t in tokens) == "one two "
    assert summary.finish_reason == messages.FINISH_REASON_STOP
    assert summary.output_tokens == len(text_ids("one two STOP")) == len(tokens)
    assert backend.cancel_events[-1].is_set() and backend.aborted.is_set(), "the backend was told to stop"


def test_text_held_for_a_possible_stop_string_comes_out_at_the_end(gateway, backend):
    backend.reply = text_ids("abcST")
    tokens, summary = split(generate(gateway.grpc_port, prompt_text="q", max_tokens=5, stop=["STOP"]))
    assert [t.text for t in tokens] == ["a", "b", "c", "", "ST"]
    assert [t.token_id for t in tokens] == backend.reply
    assert summary.finish_reason == messages.FINISH_REASON_LENGTH
    backend.reply = text_ids("xSTyz")  # a false start releases the held text with the token that breaks it
    tokens, _ = split(generate(gateway.grpc_port, prompt_text="q", max_tokens=5, stop=["STOP"]))
    assert "".join(t.text for t in tokens) == "xSTyz" and len(tokens) == 5


def test_stop_string_applies_to_a_token_id_prompt_too(gateway, backend):
    backend.reply = text_ids("abc.def")
    tokens, summary = split(generate(gateway.grpc_port, prompt_token_ids=[1, 9], max_tokens=20, stop=["."]))
    assert [t.token_id for t in tokens] == text_ids("abc.")
    assert all(t.text == "" for t in tokens), "text only for a text prompt"
    assert summary.finish_reason == messages.FINISH_REASON_STOP


@pytest.mark.parametrize("fields, message", [
    ({}, "prompt is empty"),
    ({"prompt_text": ""}, "prompt is empty"),
    ({"prompt_text": "hi", "prompt_token_ids": [1, 2]}, "not both"),
    ({"prompt_token_ids": [1, 600]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2], "max_tokens": -3}, "max_tokens must be at least 1"),
    ({"prompt_token_ids": [1, 2], "max_tokens": 0}, "max_tokens must be at least 1"),
    ({"prompt_token_ids": [1] * 64}, "context is 64"),
    ({"prompt_token_ids": [1] * 60, "max_tokens": 10}, "exceeds the model's context of 64"),
    ({"prompt_text": "x" * 100}, "context is 64"),
    ({"prompt_token_ids": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt_token_ids": [1, 2], "temperature": float("nan")}, "temperature"),
    ({"prompt_token_ids": [1, 2], "top_p": 0}, "top_p"),
    ({"prompt_token_ids": [1, 2], "top_p": 1.5}, "top_p"),
    ({"prompt_token_ids": [1, 2], "stop": [""]}, "stop strings must not be empty"),
    ({"prompt_token_ids": [1, 2], "stop_token_ids": [999]}, "stop token 0"),
    ({"prompt_token_ids": [1, 2], "model": "gpt-4"}, "unknown model 'gpt-4'"),
    ({"prompt_token_ids": [1, 2], "seed": 2**63}, "seed"),
])
def test_bad_requests_are_invalid_argument_with_the_reason(gateway, backend, fields, message):
    err = grpc_error(gateway.grpc_port, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()
    assert backend.requests == [], "nothing reached the backend"


def test_the_model_may_be_named(gateway):
    tokens, _ = split(generate(gateway.grpc_port, prompt_token_ids=[1, 4], max_tokens=1, model="fake-model"))
    assert len(tokens) == 1


def test_backend_errors_map_to_status_codes(gateway, backend):
    backend.fail = Rejected("decode is full", retry_after_s=2.5, stage="early", cause="tbt_slo")
    err = grpc_error(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=3)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "decode is full" in err.details()
    trailing = dict(err.trailing_metadata())
    assert (trailing["retry-after-s"], trailing["rejected-stage"], trailing["rejected-cause"]) == ("2.5", "early",
                                                                                                   "tbt_slo")
    backend.fail = Unavailable("instance p0 died")
    err = grpc_error(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=3)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "p0 died" in err.details()
    backend.fail = InvalidRequest("token 5 is reserved")
    err = grpc_error(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=3)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in err.details()
    backend.fail = RuntimeError("bug")
    err = grpc_error(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=3)
    assert err.code() == grpc.StatusCode.INTERNAL
    backend.fail = None
    tokens, _ = split(generate(gateway.grpc_port, prompt_token_ids=[1, 5], max_tokens=3))
    assert len(tokens) == 3, "the server still serves"


def test_late_rejection_and_mid_stream_failure_after_tokens(gateway, backend):
    backend.fail_after = (2, Unavailable("decode instance lost"))
    with grpc_channel(gateway.grpc_port) as channel:
        call = services.GatewayStub(channel).Generate(
            messages.GenerateRequest(prompt_token_ids=[1, 5, 6], max_tokens=5), timeout=WAIT_S)
        got = []
        with pytest.raises(grpc.RpcError) as info:
            for response in call:
                got.append(response.token.token_id)
    assert got == [5, 6] and info.value.code() == grpc.StatusCode.UNAVAILABLE
    backend.reset()
    backend.fail = Rejected("TBT SLO", retry_after_s=1, stage=REJECT_LATE)
    assert grpc_error(gateway.grpc_port, prompt_token_ids=[1, 5]).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("how", ["cancel", "close_channel"])
def test_client_going_away_mid_stream_sets_cancelled(gateway, backend, how):
    backend.pause_after = 2
    channel = grpc_channel(gateway.grpc_port)
    call = services.GatewayStub(channel).Generate(messages.GenerateRequest(prompt_token_ids=[1, 5, 6],
                                                                           max_tokens=10), timeout=WAIT_S)
    assert [next(call).token.token_id for _ in range(2)] == [5, 6]
    assert not backend.cancel_events[-1].is_set()
    if how == "cancel":
        call.cancel()
    channel.close()
    assert wait_for(backend.aborted.is_set), "the backend saw the cancellation and stopped"
    assert backend.cancel_events[-1].is_set()
    assert not backend.release.is_set()


def test_list_models(gateway):
    with grpc_channel(gateway.grpc_port) as channel:
        reply = services.GatewayStub(channel).ListModels(messages.ListModelsRequest(), timeout=WAIT_S)
    (model,) = reply.models
    assert (model.name, model.vocab_size, model.max_context, model.tokenizer) == ("fake-model", 512, 64, "byte")


def test_health_and_reflection(gateway):
    with grpc_channel(gateway.grpc_port) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "mooncake.v1.Gateway"):
            status = check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "mooncake.v1.Gateway" in db.get_services()
        methods = {m.name for m in db.FindFileContainingSymbol("mooncake.v1.Gateway").service[0].method}
        assert {"Generate", "ListModels"} <= methods


def test_token_gates_every_rpc_but_health():
    backend = FakeBackend()
    with GatewayServer(backend, auth_token="s3cret", http_port=None) as gw:
        port = gw.grpc_port
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)]:
            with pytest.raises(grpc.RpcError) as info:
                generate(port, metadata=metadata, prompt_token_ids=[1, 5])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc_channel(port) as channel, pytest.raises(grpc.RpcError) as info:
            services.GatewayStub(channel).ListModels(messages.ListModelsRequest(), timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc_channel(port) as channel, pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert backend.requests == []
        tokens, _ = split(generate(port, metadata=(("authorization", "Bearer s3cret"),), prompt_token_ids=[1, 5],
                                   max_tokens=2))
        assert len(tokens) == 2
        with grpc_channel(port) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_no_open_gateway_off_loopback():
    with pytest.raises(ValueError, match="without an auth_token"):
        GatewayServer(FakeBackend(), host="0.0.0.0")
    GatewayServer(FakeBackend(), host="0.0.0.0", auth_token="t", grpc_port=None, http_port=None).stop()
    GatewayServer(FakeBackend(), host="::1", grpc_port=None, http_port=None).stop()
