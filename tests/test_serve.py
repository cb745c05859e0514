"""``mooncake-jax serve`` as a user runs it: separate instance processes behind the gateway, on loopback ports it
picks; gRPC streaming, OpenAI HTTP (streaming and not), health and reflection; greedy output equal to the single
engine; a clean shutdown on SIGINT that leaves no process behind."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import mooncake_jax as mj
from mooncake_jax.instance.serve import _profile_json
from mooncake_jax.proto import load
from tiny_profile import PROFILE

gateway_messages, gateway_services = load("gateway")
SERVED_AS = "tiny-served"  # --served-model-name: the id in /v1/models, which requests must name
PROMPT = [1, 17, 42, 99, 250, 3, 77, 301, 12, 5, 400, 8, 19, 23, 64, 2, 9, 11, 13]


def children_of(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    profile = log.parent / "profile.json"  # given, so the instances skip measuring their engine at start
    profile.write_text(PROFILE)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mooncake_jax.cli", "serve", "--model", "tiny", "--prefill",
                                 "1", "--decode", "1", "--no-warmup", "--compile-cache", "none",
                                 "--profile-file", str(profile),
                                 "--drain-grace-s", "3", "--log-dir", str(log.parent / "instances"),
                                 "--served-model-name", SERVED_AS],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    proc.log = log
    line = {}
    reader = threading.Thread(target=lambda: line.update(text=proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(300)
    if not line.get("text", "").startswith("READY"):
        proc.kill()
        pytest.fail(f"serve did not become ready: {line}")
    ports = dict(part.split("=") for part in line["text"].split()[1:])
    yield proc, int(ports["grpc"]), int(ports["http"])
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def expected():
    return mj.LLM("tiny").generate([PROMPT], max_new_tokens=6, ignore_eos=True)[0]


def post(port, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


def test_openai_http_plain_and_streaming(served, expected):
    _, _, http = served
    with post(http, {"model": SERVED_AS, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}) as r:
        body = json.loads(r.read())
    assert body["choices"][0]["token_ids"] == expected
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == len(PROMPT)
    with post(http, {"model": SERVED_AS, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": True}) as r:
        lines = [raw.decode().strip() for raw in r if raw.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[len("data: "):]) for x in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == expected
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=30) as r:
        assert json.loads(r.read())["data"][0]["id"] == SERVED_AS


def test_grpc_generate_health_and_reflection(served, expected):
    _, port, _ = served
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_services.GatewayStub(channel)
        events = list(stub.Generate(gateway_messages.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=6,
                                                                     ignore_eos=True), timeout=120))
        assert [e.token.token_id for e in events if e.HasField("token")] == expected
        summary = events[-1].summary
        assert summary.output_tokens == 6 and summary.ttft_s > 0
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_messages.GenerateRequest(prompt_token_ids=[]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert "mooncake.v1.Gateway" in names and "grpc.health.v1.Health" in names


def test_bad_http_input_gets_400_and_the_server_keeps_serving(served, expected):
    _, _, http = served
    for body in ({"model": SERVED_AS, "prompt": [], "max_tokens": 3}, {"model": "nope", "prompt": [1]},
                 {"model": SERVED_AS, "prompt": [1], "max_tokens": -1}):
        with pytest.raises(urllib.error.HTTPError) as err:
            post(http, body)
        assert err.value.code == 400 and "error" in json.loads(err.value.read())
    with post(http, {"model": SERVED_AS, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}) as r:
        assert json.loads(r.read())["choices"][0]["token_ids"] == expected


@pytest.mark.slow  # waits for a restart (suite budget); test_chaos covers the 503 in-process
def test_health_turns_503_when_the_decode_instance_dies_and_serve_restarts_it(served, expected):
    """Last but one (it kills the decode instance): a request gets 503 naming it (not 429), /health and the gRPC
    health service say what is missing, and serve restarts the instance (the reason in its log)."""
    proc, grpc_port, http = served
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=30) as r:
        assert r.status == 200
    decode = [pid for pid in children_of(proc.pid)
              if b"--role\0decode" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(decode) == 1
    os.kill(decode[0], signal.SIGKILL)
    time.sleep(0.3)
    with pytest.raises(urllib.error.HTTPError) as err:  # the first call to it finds it dead: dropped at once
        post(http, {"model": SERVED_AS, "prompt": PROMPT, "max_tokens": 3})
    assert err.value.code == 503 and "decode" in json.loads(err.value.read())["error"]["message"]

    def health():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = health()
    assert status == 503 and "no decode instance alive" in body["error"]["message"]
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    deadline = time.monotonic() + 240  # restarted after a backoff, then it starts as at first
    while health()[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health()[0] == 200
    with post(http, {"model": SERVED_AS, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}) as r:
        assert json.loads(r.read())["choices"][0]["token_ids"] == expected
    assert len(children_of(proc.pid)) == 2  # the dead one reaped, one new
    text = proc.log.read_text()
    assert "decode-0" in text and "killed by SIGKILL" in text and "restarted" in text


def test_sigterm_drains_and_stops_everything(served):
    """SIGTERM: the open stream finishes within the grace or ends with an error event, then ``[DONE]``; serve
    exits 0 with no traceback in its log and no instance left behind."""
    proc, _, http = served
    instances = children_of(proc.pid)
    assert len(instances) == 3  # one prefill, one decode and the Conductor process
    response = post(http, {"model": SERVED_AS, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True,
                           "stream": True})
    lines = [response.readline().decode().strip()]
    proc.send_signal(signal.SIGTERM)
    lines += [raw.decode().strip() for raw in response if raw.strip()]
    assert lines[0].startswith("data: ") and lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    assert proc.wait(60) == 0
    assert "Traceback" not in proc.log.read_text()
    for pid in instances:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_bad_profile_file_is_refused_by_name(tmp_path):
    assert _profile_json(None) is None
    with pytest.raises(ValueError, match="--profile-file .*missing.json"):
        _profile_json(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        _profile_json(tmp_path / "list.json")
    (tmp_path / "p.json").write_text(PROFILE)
    assert _profile_json(tmp_path / "p.json") == PROFILE
