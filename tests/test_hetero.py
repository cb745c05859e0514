"""Unlike instances in one cluster (issue 11): one instance configuration and its serializer, per-role shapes on
their own devices, KV re-laid out between prefill and decode instances of other TP, stages, page size and dtype,
and bad cluster shapes refused before anything starts."""

import json
import os

import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.instance.cluster_spec import check_cluster, file_configs, role_configs
from mooncake_jax.instance.config import InstanceConfig
from mooncake_jax.instance.main import parse_args
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.transfer.offload import request_keys
from mooncake_jax.transfer.relayout import convert
from reference_model import random_prompts
from tiny_profile import PROFILE

FAST = dict(warmup=False, compile_cache=None, profile_json=PROFILE)
TOL = 2e-2  # bfloat16 KV against float32: relative error of the logits


# ---- the configuration -------------------------------------------------------------------------------------------
def test_one_serializer_for_command_line_json_and_registration():
    c = InstanceConfig("prefill", tensor_parallel=2, pipeline_stages=2, dtype="bfloat16", devices="0-3",
                       pool={"dram_blocks": 64, "ssd_path": "/tmp/x"}, layerwise=True, hardware="8xH800",
                       bucket_factor=2, conductor_address="127.0.0.1:1", auth_token="secret", profile_json="{}")
    assert c.devices == (0, 1, 2, 3)
    assert InstanceConfig.from_json(c.to_json(), auth_token="secret", profile_json="{}") == c
    assert parse_args(c.to_args()).replace(profile_json="{}", auth_token="secret") == c  # the child's view
    assert "secret" not in c.to_json() and "profile_json" not in c.to_dict()
    assert c.to_dict()["pool"] == {"dram_blocks": 64, "ssd_path": "/tmp/x", "ssd_blocks": None}


def test_data_plane_survives_every_serialization_and_bad_values_are_named():
    c = InstanceConfig("decode", conductor_address="127.0.0.1:1", data_plane="jax")
    assert InstanceConfig.from_json(c.to_json()).data_plane == "jax"
    assert parse_args(c.to_args()).data_plane == "jax"
    assert InstanceConfig("decode").data_plane == "auto"
    with pytest.raises(ValueError, match="data_plane must be one of .*'rdma'"):
        InstanceConfig("decode", data_plane="rdma")
    # the instance's Messenger clients use it (called on a stand-in: no engine needed to build a client)
    import threading
    from types import SimpleNamespace

    from mooncake_jax.instance.server import InstanceServer
    from mooncake_jax.transfer import BlockPool, BlockSpec

    with BlockPool(BlockSpec((1, 2, 4, 1, 8), np.float32), dram_blocks=2) as pool:
        server = SimpleNamespace(_clients_lock=threading.Lock(), _clients={}, pool=pool, config=c)
        client = InstanceServer.messenger(server, "127.0.0.1:9")
        assert client.data_plane == "jax"
        client.close()


def test_cluster_local_options_reach_every_instance():
    """Cluster.local used to drop dtype, bucket_factor and pool_ssd_path on the way to the child command line."""
    configs = role_configs("tiny", 1, 1, options=dict(dtype="bfloat16", bucket_factor=2, pool_ssd_path="/ssd",
                                                      layerwise=True))
    for c in (InstanceConfig.from_json(c.to_json()) for c in configs):
        assert (c.dtype, c.bucket_factor, c.pool.ssd_path) == ("bfloat16", 2, "/ssd")
    assert [c.layerwise for c in configs] == [True, False]  # layer-wise is a prefill matter


def test_per_role_shapes_get_their_own_devices():
    configs = role_configs("tiny", 1, 1, per_role={"prefill": {"shape": "tensor=2,stage=2", "dtype": "bfloat16"},
                                                   "decode": {"shape": "tensor=4", "block_size": 32}})
    p, d = check_cluster("tiny", configs, 8)
    assert (p.tensor_parallel, p.pipeline_stages, p.dtype, p.devices) == (2, 2, "bfloat16", (0, 1, 2, 3))
    assert (d.tensor_parallel, d.pipeline_stages, d.block_size, d.devices) == (4, 1, 32, (4, 5, 6, 7))


def test_cluster_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"model": "tiny", "instances": [
        {"role": "prefill", "shape": "tensor=2,stage=2", "devices": "4-7", "layerwise": True},
        {"role": "decode", "count": 2, "tensor_parallel": 2, "dtype": "float32"}]}))
    model, configs = file_configs(path)
    configs = check_cluster(model, configs, 8)
    assert [(c.instance_id, c.devices) for c in configs] == [("prefill-0", (4, 5, 6, 7)), ("decode-0", (0, 1)),
                                                            ("decode-1", (2, 3))]


@pytest.mark.parametrize("kwargs, message", [
    (dict(instances=[{"role": "prefill"}, {"role": "decode", "model": "small"}]),
     "model 'small' is not the cluster's model 'tiny'"),
    (dict(prefill=1, prefill_shape="tensor=4", decode_shape="tensor=4,stage=2"),
     "needs 8 devices but only 4 are left: the cluster's shapes need 12 devices, 8 exist"),
    (dict(instances=[{"role": "prefill", "devices": "6-9", "tensor_parallel": 4}, {"role": "decode"}]),
     r"device 8, which does not exist; allowed: 0-7"),
    (dict(instances=[{"role": "prefill", "devices": "0-3", "tensor_parallel": 4},
                     {"role": "decode", "devices": "2-3", "tensor_parallel": 2}]),
     r"devices 2-3 overlap prefill-0's 0-3 \(device 2\)"),
    (dict(prefill_shape="tensor=3"), r"tensor=3 does not divide tiny's 8 attention heads / 2 KV heads; "
                                     r"allowed: \[1, 2, 4, 8\]"),
    (dict(decode_shape="stage=5"), "stage=5 is more stages than tiny's 4 layers; allowed: 1 to 4"),
    (dict(hardware="9xB300"), r"unknown hardware profile '9xB300'; allowed: \['8xA800'"),
    (dict(prefill_shape="tensor=2,pipes=2"), "bad mesh spec part 'pipes=2'"),
    (dict(prefill_dtype="int8"), "dtype 'int8' is not supported"),
    (dict(instances=[{"role": "prefill", "dtype": "bfloat16"}, {"role": "prefill"}, {"role": "decode"}]),
     r"prefill instances have dtypes \['bfloat16', 'float32'\]; they must share one"),
    (dict(instances=[{"role": "prefill"}, {"role": "prefill", "block_size": 32}, {"role": "decode"}]),
     r"prefill instances have block sizes \[16, 32\]; they must share one"),
    (dict(instances=[{"role": "prefill", "devices": "0-1"}, {"role": "decode"}]),
     r"devices 0-1 are 2 device\(s\), its shape tensor=1,stage=1 needs 1"),
])
def test_bad_cluster_shapes_are_refused_before_anything_starts(kwargs, message, monkeypatch):
    started = []
    monkeypatch.setattr("mooncake_jax.instance.cluster.serve_conductor", lambda *a, **k: started.append(1))
    with pytest.raises(ValueError, match=message):
        mj.Cluster.local("tiny", **kwargs)
    assert not started


# ---- KV between unlike instances ---------------------------------------------------------------------------------
def test_unlike_cluster_serves_the_single_engines_greedy_tokens():
    """A CPP+TP layer-wise prefill instance (tensor=2, stage=2, 16-token pages) and a TP decode instance
    (tensor=4, 32-token pages), each on its own 4 of the 8 devices, float32: exactly ``mj.LLM``'s tokens."""
    prompts = random_prompts([5, 16, 33, 70], seed=3)
    want = mj.LLM("tiny").generate(prompts, max_new_tokens=6)
    with mj.Cluster.local("tiny", prefill=1, decode=1, prefill_shape="tensor=2,stage=2", decode_shape="tensor=4",
                          decode_block_size=32, layerwise=True, prefill_chunk_size=32, ttft_slo_s=600.0,
                          **FAST) as cluster:  # unwarmed: a loaded host's first compiles must not read as an SLO miss
        assert cluster.generate(prompts, max_new_tokens=6) == want
        prefill, decode = cluster.instances["prefill-0"], cluster.instances["decode-0"]
        assert {d.id for d in prefill.engine.layout.mesh.devices.flat} == {0, 1, 2, 3}
        assert {d.id for d in decode.engine.layout.mesh.devices.flat} == {4, 5, 6, 7}
        assert (decode.kv_layout.block_size, decode.kv_layout.tensor) == (32, 4)
        assert prefill.stats()["prefill_pushed_blocks_total"] == 0  # nothing pushed: the decode side pulls and converts
        assert decode.stats()["decode_requests_total"] == len(prompts)


def test_kv_incompatible_instance_is_refused_at_registration_and_its_kv_at_the_decode_rpc():
    import grpc

    from mooncake_jax.instance.rpc import messages
    from mooncake_jax.instance.server import InstanceServer, RegistrationError
    from mooncake_jax.kv_layout import KVLayout
    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.llama import init_model

    with mj.Cluster.local("tiny", prefill=1, decode=1, **FAST) as cluster:
        foreign = KVLayout(n_layers=4, n_kv_heads=4, head_dim=16, block_size=16, dtype="float32")
        decode = cluster.instances["decode-0"]
        with pytest.raises(grpc.RpcError) as e:
            next(cluster.backend.instance_stub(decode.address).Decode(messages.DecodeRequest(
                request_id="r", prompt=[1, 2, 3], first_token=4, kv_keys=[1], kv_source="x",
                sampling=messages.Sampling(max_tokens=4),
                kv_layout=foreign.to_json()), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV heads differ: 4 vs 2" in e.value.details()
        other = init_model(get_config("tiny").replace(n_kv_heads=4), 0)
        config = InstanceConfig("decode", conductor_address=cluster.conductor.address, profile_json=PROFILE,
                                warmup=False)
        server = InstanceServer(config, other)
        try:
            server.start()  # refused: it takes itself down
        except RegistrationError as e:
            assert "INVALID_ARGUMENT" in str(e) and "KV heads differ: 4 vs 2" in str(e)
        else:
            server.stop()
            pytest.fail("an instance of another model was registered")


def _decode_logits(engine, seq, steps):
    """Greedy decode ``steps`` tokens, keeping each step's logits (the runner's last-stage output)."""
    run, kept = engine.runner.run, []

    def keep(batch, *a, **k):
        out = run(batch, *a, **k)
        kept.append(np.asarray(out[0][1], np.float32).reshape(-1, engine.cfg.vocab_size)[0])
        return out

    engine.runner.run = keep
    try:
        for _ in range(steps):
            engine.decode([seq])
    finally:
        engine.runner.run = run
    return kept


@pytest.mark.slow  # three engines of other shapes to compile: about 45 s on 2 cores (-m slow)
def test_bf16_cpp_tp_prefill_to_f32_tp_decode_logits_within_bf16_tolerance():
    small = dict(max_batch=1, num_pages=16)  # one sequence at a time: few programs to compile
    prefill = mj.LLM("tiny", tensor_parallel=2, pipeline_stages=2, dtype="bfloat16", block_size=16,
                     prefill_chunk_size=32, **small)
    decode = mj.LLM("tiny", tensor_parallel=4, dtype="float32", block_size=32, **small)
    ref = mj.LLM("tiny", **small)
    src = InstanceConfig("prefill", tensor_parallel=2, pipeline_stages=2, dtype="bfloat16").kv_layout(prefill.config)
    dst = InstanceConfig("decode", tensor_parallel=4, dtype="float32", block_size=32).kv_layout(decode.config)
    checked = 0
    for prompt in random_prompts([37, 60], seed=5):
        params = SamplingParams(max_new_tokens=8)
        p_seq = prefill.engine.new_sequence(prompt, params)
        prefill.engine.admit(p_seq)
        prefill.engine.prefill(p_seq)
        blocks = prefill.engine.read_blocks(p_seq.pages[: -(-len(prompt) // 16)])
        prefill.engine.release(p_seq)
        converted = convert(blocks, src, dst, len(prompt))
        d_seq = decode.engine.new_sequence(prompt, params)
        pages = decode.engine.load_blocks(request_keys(d_seq, 32), converted)
        decode.engine.adopt(d_seq, pages, p_seq.output[0])
        logits = _decode_logits(decode.engine, d_seq, 7)
        decode.engine.release(d_seq)
        tokens = list(prompt) + d_seq.output
        want = ref.score(tokens)[len(prompt): len(prompt) + 7]  # logits after the first token, and so on
        for step, (got, exp) in enumerate(zip(logits, want)):
            rel = np.abs(got - exp).max() / np.abs(exp).max()
            assert rel <= TOL, f"step {step}: relative error {rel:.4f}"
            top2 = np.sort(exp)[-2:]
            if top2[1] - top2[0] > TOL * np.abs(exp).max():
                assert d_seq.output[step + 1] == int(np.argmax(exp)), f"step {step}"
                checked += 1
    assert checked >= 4  # the token check is not vacuous


@pytest.mark.slow  # two instance processes to start and compile: about a minute on 2 cores (-m slow)
def test_unlike_instance_processes_own_their_devices():
    """As ``serve`` runs them: each instance a child process given its config on the command line, with the device
    ids it owns (a child of this 8-device process asks JAX for them itself)."""
    prompts = random_prompts([9, 40], seed=4)
    want = mj.LLM("tiny").generate(prompts, max_new_tokens=5)
    with mj.Cluster.local("tiny", prefill=1, decode=1, processes=True, prefill_shape="tensor=2",
                          decode_shape="tensor=2", decode_block_size=32, **FAST) as cluster:
        assert cluster.generate(prompts, max_new_tokens=5) == want
        assert [c.devices for c in cluster.configs] == [(0, 1), (2, 3)]


def test_conductor_hands_out_slos_and_refuses_unexchangeable_kv_at_registration():
    import grpc

    from mooncake_jax.conductor import PolicyConfig
    from mooncake_jax.conductor.service import messages, serve, services
    from mooncake_jax.kv_layout import KVLayout

    def lay(**changes):
        return KVLayout(**{"n_layers": 4, "n_kv_heads": 2, "head_dim": 16, "block_size": 16, "dtype": "float32",
                           **changes}).to_json()

    server = serve(PolicyConfig(block_size=16, ttft_slo_s=7.0, tbt_slo_s=0.25), port=0, sweep=False)
    channel = grpc.insecure_channel(server.address)
    stub = services.ConductorStub(channel)

    def register(name, role, layout):
        return stub.Register(messages.RegisterRequest(instance_id=name, role=role, address=f"{name}:1",
                                                      hardware="8xA800", model="llama2-70b", kv_layout=layout))

    try:
        reply = register("p0", messages.PREFILL, lay(tensor=2, stage_layers=(2, 2)))
        assert (reply.ttft_slo_s, reply.tbt_slo_s, reply.block_size) == (7.0, 0.25, 16)
        assert register("d0", messages.DECODE, lay(block_size=32, dtype="bfloat16", tensor=4)).tbt_slo_s == 0.25
        assert register("p1", messages.PREFILL, lay(tensor=4)).block_size == 16  # another TP: same blocks
        for name, role, layout, message in [
                ("d1", messages.DECODE, lay(n_kv_heads=4), "KV heads differ: 4 vs 2"),
                ("d2", messages.DECODE, lay(head_dim=8), "head_dim differ: 8 vs 16"),
                ("p2", messages.PREFILL, lay(block_size=32), "prefill block_size 32 differs from the cluster's 16"),
                ("p3", messages.PREFILL, lay(dtype="bfloat16"), "prefill KV dtype bfloat16 differs")]:
            with pytest.raises(grpc.RpcError) as e:
                register(name, role, layout)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), name
    finally:
        channel.close()
        server.stop(0)


# ---- demo --hetero ------------------------------------------------------------------------------------------------
def test_demo_hetero_cluster_is_unlike_and_fits_its_devices():
    """``demo --hetero``'s shapes as the cluster checks them: every instance on its own devices, prefill and decode
    unlike in tensor parallelism, dtype and page size; the summary's ``instances`` names each one's shape."""
    from mooncake_jax.demo import HETERO, describe_instances
    from mooncake_jax.model.config import get_config

    per_role = {role: {k[len(role) + 1:]: v for k, v in HETERO.items() if k.startswith(role + "_")}
                for role in ("prefill", "decode")}
    options = {k: v for k, v in HETERO.items() if not k.startswith(("prefill_", "decode_"))}
    cfg = get_config("tiny")
    assert HETERO["prefill_num_pages"] == 1 + 2 * -(-cfg.max_seq_len // HETERO["prefill_block_size"])
    configs = check_cluster("tiny", role_configs("tiny", 2, 1, options=options, per_role=per_role), 4)
    assert [c.num_pages for c in configs] == [HETERO["prefill_num_pages"]] * 2 + [None]  # decode: its default
    described = {d["instance_id"]: d for d in describe_instances(configs, get_config("tiny"))}
    assert described["prefill-0"] == {"instance_id": "prefill-0", "role": "prefill", "shape": "tensor=1,stage=1",
                                      "tensor_parallel": 1, "pipeline_stages": 1, "dtype": "bfloat16",
                                      "block_size": 16, "layerwise": True, "devices": "0"}
    assert described["prefill-1"]["devices"] == "1"
    assert described["decode-0"] == {"instance_id": "decode-0", "role": "decode", "shape": "tensor=2,stage=1",
                                     "tensor_parallel": 2, "pipeline_stages": 1, "dtype": "float32",
                                     "block_size": 32, "layerwise": False, "devices": "2-3"}
    with pytest.raises(ValueError, match="needs 2 devices but only 1 are left"):  # one device short
        check_cluster("tiny", role_configs("tiny", 2, 1, options=options, per_role=per_role), 3)


def test_instance_processes_number_their_cpu_devices_from_zero():
    """On the CPU platform each instance process gets its devices renumbered from 0 (its own fake devices), so
    instances of one shape compile for the same device assignment and share the persistent compile cache, whose
    keys include it on CPU; on other platforms, and for multi-process instances, the ids are kept."""
    from mooncake_jax.instance.cluster import child_config

    decode = InstanceConfig("decode", tensor_parallel=2, devices="2-3")
    assert child_config(decode, cpu_platform=True).devices == (0, 1)
    assert child_config(decode, cpu_platform=True).replace(devices=(2, 3)) == decode  # nothing else changes
    assert child_config(decode, cpu_platform=False).devices == (2, 3)
    single = InstanceConfig("prefill")
    assert child_config(single, cpu_platform=True).devices is None


@pytest.mark.slow  # two unlike engines to compile and measure: minutes on 2 shared cores (-m slow)
@pytest.mark.timeout(1200)  # cold (no compilation cache): ~200 programs at 1-3 s each
def test_demo_hetero_summary(tmp_path):
    """One prefill instance, not the demo's two: every instance of an in-process cluster compiles its own programs
    for its own devices, and three unlike engines' (~330 programs) need more memory mappings than Linux gives a
    process by default (``model/map_budget.py``); two fit. Admission ``none``: this checks the unlike instances'
    plumbing, and both engines' first requests in one process on two cores ran past the 2 s TTFT SLO (all three
    refused early in one run), which is admission doing its job, not what this test is about."""
    import argparse

    from mooncake_jax import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--hetero", "--in-process", "--prefill", "1", "--admission", "none", "--requests", "3",
                              "--speed", "4", "--json", str(tmp_path / "demo.json")])
    assert demo.run(args) == 0
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert {"slo_attainment", "tbt_p99_s", "ttft_p50_s", "transfer_bytes"} <= set(summary)
    assert {(i["role"], i["tensor_parallel"], i["dtype"], i["block_size"]) for i in summary["instances"]} == {
        ("prefill", 1, "bfloat16", 16), ("decode", 2, "float32", 32)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flagged, expected", [(None, 3), (8, 8)])
def test_an_in_process_cluster_gets_the_cpu_devices_its_shapes_take(flagged, expected):
    """``Cluster.local(processes=False)`` in a fresh process (one CPU device by default) asks JAX for the devices
    its instances' shapes take before JAX starts: a tensor=2 decode instance beside a prefill instance needs 3.
    (``demo --hetero --in-process`` counted them itself; a user's script had no way to.) It never takes devices
    from a process that asked XLA for more (``--xla_force_host_platform_device_count=8``: JAX's own setting would
    override the flag)."""
    import subprocess
    import sys

    script = f"""
import jax, mooncake_jax as mj
with mj.Cluster.local("tiny", prefill=1, decode=1, processes=False, decode_shape="tensor=2", warmup=False,
                      compile_cache=None, profile_json={PROFILE!r}) as cluster:
    print("devices", jax.device_count(), sorted(cluster.instances))
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the suite's 8 fake devices would hide it
    if flagged:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={flagged}"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"devices {expected} ['decode-0', 'prefill-0']" in out.stdout
