"""Tensor parallelism and chunked pipeline parallelism on 8 CPU devices, against the single-device engine."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mooncake_jax as mj
from mooncake_jax.sharding import MeshSpec, pipeline_schedule, split_layers
from mooncake_jax.sharding.mesh import TENSOR

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest.py)")

PROMPT = np.random.default_rng(0).integers(0, 512, 70).tolist()
SHORT = PROMPT[:20]
CHUNK = 32  # 70 tokens -> chunks of 32, 32, 6


@pytest.fixture(scope="module")
def single():
    llm = mj.LLM("tiny", prefill_chunk_size=CHUNK)
    return llm.score(PROMPT), llm.generate([PROMPT, SHORT], max_new_tokens=6)


@pytest.mark.parametrize("tensor, stages", [
    # -m slow (the suite's 10-minute budget): tensor and stages stay in the default suite together, scanned below,
    # layer-wise in test_offload.py's tensor=2,stages=2 case and unrolled in test_hetero.py's tensor=2,stage=2
    # prefill instance beside a tensor=4 decode instance
    pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(1, 2, marks=pytest.mark.slow),
    pytest.param(4, 2, marks=pytest.mark.slow),
    pytest.param(4, 1, marks=pytest.mark.slow), pytest.param(8, 1, marks=pytest.mark.slow),
    pytest.param(1, 4, marks=pytest.mark.slow)])
def test_sharded_engine_equals_single_device(single, tensor, stages):
    logits, greedy = single
    llm = mj.LLM("tiny", tensor_parallel=tensor, pipeline_stages=stages, prefill_chunk_size=CHUNK)
    got = llm.score(PROMPT)
    assert np.max(np.abs(got - logits)) / np.max(np.abs(logits)) <= 1e-4
    assert llm.generate([PROMPT, SHORT], max_new_tokens=6) == greedy
    check_placement(llm, tensor, stages)


def test_scanned_stages_with_tensor_parallelism_equal_single_device(single):
    """Stacked layers under lax.scan (the GPU/TPU default), each CPP stage scanning its slice of the stack over
    tensor-parallel devices: same logits and greedy tokens."""
    from mooncake_jax.model.engine import Engine
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.sharding import MeshLayout

    logits, greedy = single
    base = mj.LLM("tiny", prefill_chunk_size=CHUNK, num_pages=2)  # only for its model
    engine = Engine(base.model, layout=MeshLayout(base.config, MeshSpec(2, 2)), prefill_chunk_size=CHUNK,
                    scan_layers=True)
    for stage in engine.runner.stages:
        assert stage.scan and jax.tree.leaves(stage.params["layers"])[0].shape[0] == 2  # its slice of the stack
    seq = engine.new_sequence(PROMPT, SamplingParams(max_new_tokens=6))
    engine.admit(seq)
    got = engine.prefill(seq, all_logits=True)
    assert np.max(np.abs(got - logits)) / np.max(np.abs(logits)) <= 1e-4
    while not seq.finished:
        engine.decode([seq])
    assert seq.output == greedy[0]


# What the rules table says each tiny-model parameter must look like with tensor parallelism over T devices
# (8 heads, 2 KV heads, MLP 256, vocab 512): KV heads replicate when T > 2, everything big is split.
# Layer parameters of a scanned stage are stacked: their leading "layers" axis is never split.
def expected_spec(name, tensor, stacked):
    if tensor == 1:  # a one-device axis splits nothing
        return P(*[None] * len(expected_spec(name, 2, stacked)))
    kv = TENSOR if tensor <= 2 else None
    spec = {
        "embedding": P(TENSOR, None), "lm_head": P(None, TENSOR), "scale": P(None),
        "wq": P(None, TENSOR, None), "wk": P(None, kv, None), "wv": P(None, kv, None), "wo": P(TENSOR, None, None),
        "w_gate": P(None, TENSOR), "w_up": P(None, TENSOR), "w_down": P(TENSOR, None),
    }[name]
    return P(None, *spec) if stacked else spec


def check_placement(llm, tensor, stages):
    runner = llm.engine.runner
    assert [(s.start, s.stop) for s in runner.stages] == split_layers(4, stages)
    used = set()
    for stage in runner.stages:
        devices = set(llm.engine.layout.stage_meshes[stage.index].devices.flat)
        assert len(devices) == tensor and not devices & used  # each stage on its own devices
        used |= devices
        for path, leaf in jax.tree_util.tree_leaves_with_path(stage.params):
            keys = [p.key for p in path if hasattr(p, "key")]
            name, stacked = keys[-1], keys[0] == "layers" and stage.scan  # unrolled stages: a buffer per layer
            assert set(leaf.sharding.device_set) == devices, name
            if stacked:
                assert leaf.shape[0] == stage.stop - stage.start, name  # the stage's slice of the layer stack
            spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
            assert P(*spec) == expected_spec(name, tensor, stacked), (name, leaf.sharding.spec)
            split = [leaf.shape[i] // (tensor if s == TENSOR else 1) for i, s in enumerate(spec)]
            assert leaf.addressable_shards[0].data.shape == tuple(split), name  # really split, not replicated
        kv_split = tensor if tensor <= 2 else 1
        for pages in stage.kv:  # stacked K and V: [kv_heads, stage layers * num_pages, block_size, head_dim]
            assert set(pages.sharding.device_set) == devices
            assert pages.shape == (2, (stage.stop - stage.start) * llm.engine.num_pages, 16, 16)  # own layers only
            assert pages.addressable_shards[0].data.shape[0] == 2 // kv_split  # KV pages split over KV heads


@pytest.mark.parametrize("chunks, stages", [(1, 1), (3, 3), (5, 2), (2, 4)])
def test_schedule_has_c_plus_s_minus_1_steps_and_keeps_order(chunks, stages):
    schedule = pipeline_schedule(chunks, stages)
    assert len(schedule) == chunks + stages - 1
    visits = {}
    for step, pairs in enumerate(schedule):
        assert len({s for s, _ in pairs}) == len(pairs)  # a stage does one chunk per step
        for s, c in pairs:
            visits.setdefault(c, []).append((step, s))
    for c in range(chunks):
        assert [s for _, s in visits[c]] == list(range(stages))  # every stage, in order
        assert [step for step, _ in visits[c]] == list(range(c, c + stages))  # one step after another


def test_runner_dispatches_chunks_in_the_schedule():
    llm = mj.LLM("tiny", pipeline_stages=2, prefill_chunk_size=16)
    runner = llm.engine.runner
    runner.dispatch_log = []
    llm.score(PROMPT[:64])  # 4 chunks over 2 stages
    assert [(s, c) for _, s, c in runner.dispatch_log] == [p for step in pipeline_schedule(4, 2) for p in step]
    assert max(k for k, _, _ in runner.dispatch_log) == 4  # C + S - 1 = 5 steps


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel": 16}, "needs 16 devices but only 8 exist"),
    ({"tensor_parallel": 3}, "tensor=3 does not divide the 8 attention heads"),
    ({"pipeline_stages": 5}, "cannot split 4 layers into 5 pipeline stages"),
    ({"prefill_chunk_size": 0}, "prefill_chunk_size must be a positive integer"),
    ({"tensor_parallel": 4, "pipeline_stages": 4}, "needs 16 devices"),
])
def test_bad_configurations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mj.LLM("tiny", **kwargs)


def test_mesh_spec_parsing():
    assert MeshSpec.parse("stage=2,tensor=4") == MeshSpec(2, 4)
    assert MeshSpec.parse("tensor=8") == MeshSpec(1, 8)
    for bad, msg in (("stage=2,data=2", "AXIS=SIZE"), ("stage=x", "integer"), ("tensor=0", "positive"),
                     ("stage=1,stage=2", "twice")):
        with pytest.raises(ValueError, match=msg):
            MeshSpec.parse(bad)
