"""The disaggregated cluster end to end (Conductor, prefill and decode instances in this process, on loopback):
outputs equal the single engine's, prefix reuse and the transfer path work, and every failure is an error with a
status, never a hang or a leak."""

import json
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.blocks import block_keys
from mooncake_jax.conductor.profile import build_profile
from mooncake_jax.gateway.backend import (REJECT_EARLY, REJECT_LATE, Finished, InvalidRequest, Rejected, TokenOut,
                                          Unavailable)
from mooncake_jax.instance.rpc import messages, sampling_message
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.transfer.offload import request_keys
from reference_model import random_prompts as prompts

# A fixed cost profile (roughly the tiny model on a 2-core CPU) so the instances skip measuring themselves.
PROFILE = json.dumps(build_profile(
    "tiny@test", "tiny", [(16, 0, 0.01), (64, 0, 0.012), (256, 0, 0.02), (256, 128, 0.015), (512, 0, 0.04)],
    [(1, 64, 0.003), (4, 256, 0.004), (16, 2048, 0.008)], kv_bytes_per_token=16384, nic_bytes_per_s=5e8,
    kv_capacity_tokens=100000))

def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


FAST = dict(warmup=False, compile_cache=None)  # tests compile only the few shapes they use, and leave no files




@pytest.fixture(scope="module")
def cluster():
    with mj.Cluster.local("tiny", prefill=2, decode=1, profile_json=PROFILE, heartbeat_timeout_s=1.5,
                          heartbeat_interval_s=0.25, **FAST) as c:
        yield c


@pytest.fixture(scope="module")
def llm():
    return mj.LLM("tiny")


def test_greedy_through_the_cluster_equals_the_single_engine(cluster, llm):
    ps = prompts([5, 30, 47, 80], seed=1)
    assert cluster.generate(ps, max_new_tokens=7) == llm.generate(ps, max_new_tokens=7)


def test_prefix_reuse_shows_in_the_metrics(cluster, llm):
    base = prompts([64], seed=2)[0]
    first, fin1 = cluster.run(base + [1, 2, 3], max_new_tokens=4)
    second, fin2 = cluster.run(base + [7, 8], max_new_tokens=4)
    assert fin1.cached_tokens == 0 and fin2.cached_tokens == 64  # four 16-token blocks reused
    for fin in (fin1, fin2):  # the parts of its TTFT: to the Conductor's decision, queued, computed, in order
        assert fin.decided_s > 0 and fin.prefill_queue_s >= 0 and fin.prefill_compute_s > 0
        assert fin.decided_s + fin.prefill_queue_s + fin.prefill_compute_s < fin.ttft_s
    assert fin2.decision_seq == fin1.decision_seq + 1  # one after the other: the Conductor's next decision
    assert second == llm.generate([base + [7, 8]], max_new_tokens=4)[0]
    stats = cluster.stats()
    assert stats["cluster_cached_tokens_total"] >= 64
    assert sum(v for k, v in stats.items() if k.startswith("instance_prefill_cached_tokens_total")) >= 64


def test_transfer_path_a_request_placed_where_its_prefix_is_not(cluster, llm):
    """Prefill on one instance, then force the next request onto the other prefill instance with a plan to fetch
    the prefix from the first: the blocks move through the Messenger and are reused, and the output is right."""
    a, b = (cluster.instances[f"prefill-{i}"] for i in (0, 1))
    d = cluster.instances["decode-0"]
    prefix = prompts([48], seed=3)[0]
    first = prefix + [5]
    call(a, first, d)  # a now holds the prefix blocks
    second = prefix + [9, 9, 9]
    keys = block_keys(second, 16)
    assert all(k in a.pool for k in keys) and not any(k in b.pool for k in keys)
    reply, tokens = call(b, second, d, fetch_from=a.address, fetch_keys=keys)
    assert reply.cached_tokens == 48  # all three blocks came from a, none recomputed
    assert all(k in b.pool for k in keys)
    assert b.stats()["prefill_fetched_blocks_total"] >= 3
    assert tokens == llm.generate([second], max_new_tokens=5)[0]


def post_json(port, path, body):
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_and_echo_through_the_served_cluster(cluster, llm):
    """The OpenAI completions path over the disaggregated cluster: prompt log-probabilities (``echo`` with
    ``max_tokens`` 0, as evaluation harnesses score) and generated ones (computed by the prefill instance for the
    first token, by the decode instance after) match ``mj.LLM.score``'s log-softmax to 1e-4; and /metrics exports
    every series the Grafana dashboard plots."""
    gw = cluster.gateway or cluster.serve_gateway(grpc_port=None, tokenizer="bytes")
    prompt = prompts([21], seed=11)[0]
    scored = log_softmax(llm.score(prompt))
    body = post_json(gw.http_port, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                                       "logprobs": 1})
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(prompt)
    np.testing.assert_allclose(lp["token_logprobs"][1:], [scored[i, prompt[i + 1]] for i in range(len(prompt) - 1)],
                               atol=1e-4)
    body = post_json(gw.http_port, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "echo": True,
                                                       "logprobs": 2, "ignore_eos": True})
    ids = body["choices"][0]["token_ids"]
    assert ids == llm.generate([prompt], max_new_tokens=4, ignore_eos=True)[0]
    scored = log_softmax(llm.score(prompt + ids))
    lp = body["choices"][0]["logprobs"]
    full = prompt + ids
    np.testing.assert_allclose(lp["token_logprobs"][1:], [scored[i, full[i + 1]] for i in range(len(full) - 1)],
                               atol=1e-4)
    for j in range(len(ids)):  # the top 2 alternatives of each generated token (keyed by text: two may share one)
        top = lp["top_logprobs"][len(prompt) + j]
        best = np.sort(scored[len(prompt) - 1 + j])[::-1][:2]
        assert 1 <= len(top) <= 2 and abs(max(top.values()) - best[0]) < 1e-4
        assert all(np.min(np.abs(best - v)) < 1e-4 for v in top.values())

    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    with urllib_open(f"http://127.0.0.1:{gw.http_port}/metrics") as r:
        exported = {s.name for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json").read_text())
    used = {n for p in dashboard["panels"] for t in p["targets"] for n in re.findall(r"\bmooncake_[a-z0-9_]+",
                                                                                     t["expr"])}
    assert used - exported == set()


def urllib_open(url):
    import urllib.request

    return urllib.request.urlopen(url, timeout=60)


def call(prefill, prompt, decode, fetch_from="", fetch_keys=(), before_decode=None, kv_source="", token_feed="",
         max_new_tokens=5, events=None, ignore_eos=False):
    """Drive one request by hand: Prefill on ``prefill`` (with an optional transfer plan), Decode on ``decode``
    (its stream's events appended to ``events``, if given)."""
    from mooncake_jax.instance.backend import instance_services

    sampling = sampling_message(SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))
    with grpc.insecure_channel(prefill.address) as ch:
        reply = instance_services.InstanceStub(ch).Prefill(messages.PrefillRequest(
            request_id=f"manual-{time.monotonic_ns()}", prompt=prompt, sampling=sampling, fetch_from=fetch_from,
            fetch_keys=list(fetch_keys), push_to=decode.address), timeout=60)
    if before_decode is not None:
        before_decode(reply)
    with grpc.insecure_channel(decode.address) as ch:
        got = list(instance_services.InstanceStub(ch).Decode(messages.DecodeRequest(
            request_id="manual", prompt=prompt, sampling=sampling, first_token=reply.first_token,
            kv_keys=reply.kv_keys, kv_source=kv_source, token_feed=token_feed), timeout=60))
    assert list(reply.kv_keys) == request_keys(type("S", (), {"prompt": prompt})(), 16)
    if events is not None:
        events += got
    tokens = [reply.first_token]
    for e in got:
        tokens += [e.token.token] if e.HasField("token") else list(e.tokens.tokens)
    return reply, tokens


def test_with_a_token_feed_the_decode_stream_carries_the_tokens_in_batches_and_the_feed_each(cluster, llm):
    """A Decode call with a token feed (gateway/token_feed.py) sends each generated token as one datagram, index 1
    onward, and its stream brings them all again in ``Tokens`` batches (each batch's index its first token's), none
    as single ``Token`` messages: both equal the single engine's greedy tokens."""
    import socket

    from mooncake_jax.gateway.token_feed import decode as read_datagram

    p, d = cluster.instances["prefill-0"], cluster.instances["decode-0"]
    prompt = prompts([30], seed=29)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as feed:
        feed.bind(("127.0.0.1", 0))
        feed.settimeout(10)
        events = []
        _, tokens = call(p, prompt, d, token_feed=f"127.0.0.1:{feed.getsockname()[1]}", max_new_tokens=12,
                         events=events, ignore_eos=True)
        fed = [read_datagram(feed.recv(512)) for _ in range(len(tokens) - 1)]
    assert tokens == llm.generate([prompt], max_new_tokens=12, ignore_eos=True)[0] and len(tokens) == 12
    assert fed == [("manual", i, t) for i, t in enumerate(tokens[1:], start=1)]
    batches = [e.tokens for e in events if e.HasField("tokens")]
    assert not any(e.HasField("token") for e in events) and batches
    assert [b.index for b in batches] == list(np.cumsum([1] + [len(b.tokens) for b in batches[:-1]]))


def test_tokens_whose_datagrams_are_lost_still_come_by_the_backend_stream(cluster, llm):
    """A token feed that nobody reads (every datagram lost): the cluster backend still yields each token once, in
    index order, from the decode stream's batches, equal to the single engine's."""
    import socket

    from mooncake_jax.gateway.backend import GenerateRequest

    prompt = prompts([26], seed=31)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as unread:
        unread.bind(("127.0.0.1", 0))
        items = list(cluster.backend.generate(GenerateRequest(
            prompt=prompt, max_tokens=10, ignore_eos=True, token_feed=f"127.0.0.1:{unread.getsockname()[1]}")))
    outs = [i for i in items if isinstance(i, TokenOut)]
    assert [o.index for o in outs] == list(range(10)) and isinstance(items[-1], Finished)
    assert [o.token for o in outs] == llm.generate([prompt], max_new_tokens=10, ignore_eos=True)[0]


def test_decode_fetches_kv_evicted_from_its_pool_since_the_push(cluster, llm):
    """The decode pool may evict a pushed block before the request is admitted (LRU under load): the decode
    instance fetches it again from the prefill instance named in the request, instead of failing it."""
    p, d = cluster.instances["prefill-0"], cluster.instances["decode-0"]
    prompt = prompts([40], seed=8)[0]

    def evict(reply):
        for key in reply.kv_keys:
            d.pool.remove(key)
    _, tokens = call(p, prompt, d, before_decode=evict, kv_source=p.address)
    assert tokens == llm.generate([prompt], max_new_tokens=5)[0]
    with pytest.raises(grpc.RpcError) as err:  # without a source to fetch from, it is an error, not garbage
        call(p, prompts([40], seed=9)[0], d, before_decode=evict)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("prompt, kwargs, message", [
    ([], {}, "prompt is empty"),
    ([1, 600], {}, "outside the vocabulary"),
    ([1] * 4090, {"max_new_tokens": 10}, "exceeds the model's context"),
    ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ([1, 2], {"temperature": -1.0}, "temperature must be >= 0"),
])
def test_bad_input_is_invalid_request(cluster, prompt, kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        list(cluster.stream(prompt, **kwargs))
    assert cluster.generate([[1, 2, 3]], max_new_tokens=2)[0]  # nothing else disturbed


def test_client_disconnect_frees_the_kv(cluster):
    d = cluster.instances["decode-0"]
    cancelled = threading.Event()
    stream = cluster.stream(prompts([40], seed=4)[0], max_new_tokens=500, cancelled=cancelled)
    got = [next(stream), next(stream)]
    assert all(isinstance(x, TokenOut) for x in got)
    cancelled.set()
    rest = list(stream)
    assert isinstance(rest[-1], Finished) and rest[-1].reason == "abort" and len(rest) < 400
    assert wait_until(lambda: not d.loop.running and d.engine.pages_in_use == 0, 10)


def test_early_and_late_rejection():
    kw = dict(prefill=1, decode=1, profile_json=PROFILE, **FAST)
    with mj.Cluster.local("tiny", ttft_slo_s=1e-6, **kw) as c:  # nothing can meet this TTFT: rejected up front
        with pytest.raises(Rejected) as e:
            c.run([1, 2, 3], max_new_tokens=3)
        assert e.value.stage == REJECT_EARLY and e.value.retry_after_s > 0
        assert c.stats()["cluster_rejected_early_total"] == 1
    with mj.Cluster.local("tiny", admission="none", tbt_slo_s=1e-6, **kw) as c:  # the decode side says no
        with pytest.raises(Rejected) as e:
            c.run([1, 2, 3], max_new_tokens=3)
        assert e.value.stage == REJECT_LATE
        d = c.instances["decode-0"]
        assert d.stats()["decode_rejected_late_total"] == 1 and not d.loop.running


def test_dead_instance_is_drained_and_requests_go_elsewhere(llm):
    with mj.Cluster.local("tiny", prefill=2, decode=1, profile_json=PROFILE, heartbeat_interval_s=0.2,
                          heartbeat_timeout_s=1.0, **FAST) as c:
        victim = c.instances["prefill-0"]
        victim.link.stop(deregister=False)  # dies silently: no goodbye, no more heartbeats
        victim._server.stop(0)
        failures = 0
        for p in prompts([20] * 6, seed=5):  # before the drain some may hit the dead one: an error, not a hang
            t = time.monotonic()
            try:
                c.run(p, max_new_tokens=3)
            except Unavailable:
                failures += 1
            assert time.monotonic() - t < 30
        service = c.conductor.service
        assert wait_until(lambda: "prefill-0" not in service.state.instances.slot_of, 10)
        ps = prompts([20] * 6, seed=6)
        assert c.generate(ps, max_new_tokens=3) == llm.generate(ps, max_new_tokens=3)  # all on prefill-1


@pytest.mark.slow  # ~9 s; layer-wise prefill in a served cluster stays in test_hetero's unlike cluster (-m slow)
def test_layerwise_prefill_instances_serve_the_same_tokens(llm):
    """Prefill instances in layer-wise mode (prefix KV loaded from the pool layer by layer, new KV stored layer by
    layer) give the single engine's tokens, and reuse a prefix from their pool."""
    with mj.Cluster.local("tiny", prefill=1, decode=1, profile_json=PROFILE, layerwise=True, **FAST) as c:
        base = prompts([48], seed=7)[0]
        ps = [base + [3, 4], base + [9]]
        assert [c.run(p, max_new_tokens=5)[0] for p in ps] == llm.generate(ps, max_new_tokens=5)
        assert c.stats()["cluster_cached_tokens_total"] == 48


def test_shared_token_gates_every_internal_rpc(llm):
    """With a token, the Conductor, the instances and their Messengers refuse calls without it (health stays
    open), and the cluster's own traffic, which carries it, works."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mooncake_jax.instance.backend import conductor_messages, conductor_services, instance_services
    from mooncake_jax.transfer.messenger import MessengerClient, TransferError

    with mj.Cluster.local("tiny", prefill=1, decode=1, profile_json=PROFILE, auth_token="s3cret", **FAST) as c:
        p = prompts([20], seed=10)[0]
        assert c.generate([p], max_new_tokens=3) == llm.generate([p], max_new_tokens=3)
        prefill = c.instances["prefill-0"]
        with grpc.insecure_channel(c.conductor.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                conductor_services.ConductorStub(ch).ListInstances(conductor_messages.ListInstancesRequest(),
                                                                   timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(prefill.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                instance_services.InstanceStub(ch).Stats(messages.StatsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        for token, ok in ((None, False), ("wrong", False), ("s3cret", True)):
            client = MessengerClient(prefill.address, c.instances["decode-0"].pool, timeout_s=10, auth_token=token)
            try:
                assert client.has(block_keys(p, 16)) == [True]
                assert ok
            except TransferError as e:
                assert not ok and "UNAUTHENTICATED" in str(e)
            finally:
                client.close()


def test_serving_path_warmup_runs_requests_through_every_role(cluster):
    """``warm_serving_path`` sends its requests through the Conductor, the prefill and the decode instances (their
    counters move by exactly that many) and a refused request does not stop it."""
    def decoded():
        return sum(v for k, v in cluster.stats().items() if k.startswith("instance_decode_requests"))

    before = decoded()
    assert cluster.warm_serving_path(requests=3, max_new_tokens=2) == 3
    assert decoded() - before == 3


def test_warmup_prompts_fit_the_context_and_a_failure_is_only_counted():
    from mooncake_jax.instance.path_warmup import PROMPT_BLOCKS, warm_serving_path, warmup_prompts

    prompts = warmup_prompts(6, vocab_size=50, max_context=200, block_size=16, max_new_tokens=4)
    assert [len(p) for p in prompts] == [min(196, b * 16) for b in PROMPT_BLOCKS + PROMPT_BLOCKS[:2]]
    assert all(0 <= t < 50 for p in prompts for t in p)

    def generate(prompt):
        if len(prompt) > 100:
            raise Rejected("too long for the test")
        return [1]

    assert warm_serving_path(generate, prompts) == 4  # 16, 64, 16 and 64 tokens complete; 192 and 196 refused


def test_streamed_tokens_come_by_the_token_feed_and_equal_the_single_engine(cluster, llm):
    """The served cluster's HTTP streams take each token from whichever of the decode stream and the decode
    instance's datagrams brings it first (gateway/token_feed.py): the stream's tokens are still exactly the single
    engine's greedy ones, in order, each once, and the gateway's feed did receive tokens."""
    gw = cluster.gateway or cluster.serve_gateway(grpc_port=None, tokenizer="bytes")
    assert gw.token_feed is not None
    before = gw.token_feed.received
    for prompt in prompts([19, 40], seed=23):
        body = json.dumps({"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{gw.http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        ids = []
        with urllib.request.urlopen(request, timeout=60) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    for choice in json.loads(line[5:]).get("choices") or []:
                        ids += choice.get("token_ids") or []
        assert ids == llm.generate([prompt], max_new_tokens=12, ignore_eos=True)[0]
    assert gw.token_feed.received > before
