"""The SPMD pipeline (sharding/spmd.py): the whole chunked pipeline-parallel prefill as one program over a
(stage, tensor) mesh of 8 CPU devices, against the float64 reference model and the single-device engine."""

import jax
import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.sharding.mesh import MeshSpec
from mooncake_jax.sharding.spmd import SpmdLayout, _stack_chunks
from reference_model import random_prompts, reference_for, reference_greedy

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest.py)")

CHUNK = 16
LONG, SHORT = random_prompts([45, 7], seed=3)  # 45 tokens: chunks of 16, 16, 13


@pytest.fixture(scope="module")
def single():
    return mj.LLM("tiny", prefill_chunk_size=CHUNK)


@pytest.fixture(scope="module")
def ref(single):
    return reference_for(single.model)


def spmd_engine(single, stage, tensor, **kw):
    return Engine(single.model, layout=SpmdLayout(single.config, MeshSpec(stage, tensor)), prefill_chunk_size=CHUNK,
                  max_batch=4, **kw)


@pytest.fixture(scope="module")
def engine(single):
    return spmd_engine(single, 2, 4)


def prefill(engine, prompt, new_tokens=4):
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=new_tokens))
    engine.admit(seq)
    return seq, engine.prefill(seq, all_logits=True)


def test_params_and_kv_are_stacked_on_the_stage_axis(engine):
    programs = engine.runner.programs
    wq = programs.layers["attn"]["wq"]
    assert wq.shape[:2] == (2, 2)  # [stage, layers per stage, ...]
    assert tuple(wq.sharding.spec)[:4] == ("stage", None, None, "tensor")  # [stage, layers, embed, heads, ...]
    k, _ = engine.runner.kv[0]
    assert k.shape[0] == 2 and k.sharding.spec[0] == "stage"
    # stage s's layers live on mesh row s only
    rows = programs.mesh.devices
    for s in range(2):
        held = {shard.device for shard in wq.addressable_shards if shard.index[0] == slice(s, s + 1)}
        assert held == set(rows[s])


def test_multi_chunk_prefill_equals_reference(engine, ref):
    seq, logits = prefill(engine, LONG)
    expected = ref(LONG)
    assert logits.shape == expected.shape
    assert np.max(np.abs(logits - expected)) / np.max(np.abs(expected)) <= 1e-4
    # (its KV is checked by the next test: a prompt that reuses it must give the reference's logits)
    assert engine.read_blocks(seq.pages[:2]).shape == (2,) + engine.cfg.block_shape()
    engine.release(seq)


def test_prefix_reuse_and_batched_greedy_decode_equal_reference(engine, ref):
    first, _ = prefill(engine, LONG)
    follow = LONG[:32] + SHORT  # shares LONG's first two full blocks: only 7 tokens are computed
    second, logits = prefill(engine, follow)
    assert logits.shape[0] == len(SHORT)
    expected = ref(follow)[32:]
    assert np.max(np.abs(logits - expected)) / np.max(np.abs(expected)) <= 1e-4
    while not (first.finished and second.finished):
        engine.decode([s for s in (first, second) if not s.finished])
    assert first.output == reference_greedy(ref, LONG, 4)
    assert second.output == reference_greedy(ref, follow, 4)
    engine.release(first)
    engine.release(second)


def test_written_blocks_read_back(engine):
    pages = np.array([5, 9], np.int32)
    blocks = np.random.default_rng(1).standard_normal((2,) + engine.cfg.block_shape()).astype(np.float32)
    engine.runner.write_blocks(pages, blocks)
    assert np.array_equal(engine.runner.read_blocks(pages), blocks)


@pytest.mark.slow
def test_four_stages_one_program(single, ref):
    engine = spmd_engine(single, 4, 2)
    _, logits = prefill(engine, LONG)
    expected = ref(LONG)
    assert np.max(np.abs(logits - expected)) / np.max(np.abs(expected)) <= 1e-4


def test_chunks_are_padded_to_one_shape(engine):
    """A last chunk shorter than the others is padded: its extra tokens write to the scratch page only."""
    (prompt,) = random_prompts([45], seed=11)  # not cached by the other tests: all three chunks run
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
    engine.admit(seq)
    captured = {}
    original = engine.runner._dispatch
    engine.runner._dispatch = lambda op, payload: captured.setdefault("steps", payload)
    try:
        with pytest.raises(Exception):
            engine.prefill(seq)  # the stub returns no outputs
    finally:
        engine.runner._dispatch = original
        engine.release(seq)
    stacked = _stack_chunks(captured["steps"])
    assert stacked["tokens"].shape == (4, 1, 16) and stacked["n_chunks"] == 3  # 3 chunks in 4 slots
    assert np.all(stacked["slots"][2, 0, 13:] == 0) and np.all(stacked["slots"][2, 0, :13] > 0)
    assert stacked["ctx_len"][:, 0].tolist() == [0, 16, 32, 0]


@pytest.mark.parametrize("stage, tensor, message", [(3, 1, "does not divide"), (2, 3, "does not divide")])
def test_bad_shapes(single, stage, tensor, message):
    with pytest.raises(ValueError, match=message):
        SpmdLayout(single.config, MeshSpec(stage, tensor))


def test_pallas_attention_is_refused_with_what_to_do(single):
    import dataclasses

    for impl in ("pallas", "cpu_kernel"):
        with pytest.raises(ValueError, match=rf"runs attention='xla' only \('auto' resolves to it there\), got "
                                             rf"attention='{impl}'; use attention='xla', or one process"):
            SpmdLayout(dataclasses.replace(single.config, attention=impl), MeshSpec(2, 4))


def test_mesh_must_cover_the_devices_given(single):
    with pytest.raises(ValueError, match="needs 8 devices"):
        SpmdLayout(single.config, MeshSpec(2, 4), devices=jax.devices()[:4])


def test_layer_hooks_are_refused(engine):
    with pytest.raises(ValueError, match="layer hooks"):
        engine.runner.run([], hooks=object())


def test_stacked_prefill_shapes_by_hand():
    """A 64-token context, 16-token chunks and blocks: n chunks stack into 2 or 4 slots with the last chunk's
    context table (its start, bucketed to 1, 2 or 4 pages by the pallas attention, 4 pages always by the xla one);
    prompt logprobs reuse no prefix. (The engine's own
    enumeration over the SPMD runner's own chunk-slot rule, on a stand-in engine: nothing to compile.)"""
    from types import SimpleNamespace

    from mooncake_jax.sharding.pipeline import PipelineRunner
    from mooncake_jax.sharding.spmd import SpmdRunner

    engine = SimpleNamespace(runner=SpmdRunner, prefill_chunk_size=16, block_size=16,
                             cfg=SimpleNamespace(max_seq_len=64, attention="pallas"), max_pages_per_seq=4)
    engine.context_width = lambda pages: Engine.context_width(engine, pages)
    # n=2: last chunk starts at 16, 32 or 48 (0, 1 or 2 cached blocks) -> 1, 2, 3->4 pages; n=3: 32, 48; n=4: 48
    assert Engine.stacked_prefill_shapes(engine, False) == [(2, 1), (2, 2), (2, 4), (4, 2), (4, 4)]
    assert Engine.stacked_prefill_shapes(engine, True) == [(2, 1), (4, 2), (4, 4)]
    engine.cfg.attention = "xla"  # one context width (the longest sequence's pages) for every chunk
    assert Engine.stacked_prefill_shapes(engine, False) == [(2, 4), (4, 4)]
    assert Engine.stacked_prefill_shapes(engine, True) == [(2, 4), (4, 4)]
    engine.runner = PipelineRunner  # runs chunk by chunk: the single-chunk shapes cover it
    assert Engine.stacked_prefill_shapes(engine, False) == []


@pytest.mark.slow  # ~20 SPMD programs to compile: ~2 min on a loaded 2-core host
def test_warmup_compiles_every_prefill_shape_a_request_hits(single):
    """After warm-up, prompts of 2, 3 and 4 chunks, a cached prefix and prompt logprobs compile nothing more."""
    import dataclasses

    from mooncake_jax.model.llama import init_model
    from mooncake_jax.sharding.spmd import spmd_forward

    cfg = dataclasses.replace(single.config, max_seq_len=64)
    engine = Engine(init_model(cfg, 0), layout=SpmdLayout(cfg, MeshSpec(2, 1), devices=jax.devices()[:2]),
                    prefill_chunk_size=CHUNK, max_batch=1)
    engine.warmup(prefill=True, decode=False, blocks=False)
    compiled = spmd_forward._cache_size()
    a, b, c = random_prompts([17, 35, 63], seed=21)
    for prompt, params in [(a, SamplingParams(max_new_tokens=1)), (b, SamplingParams(max_new_tokens=1)),
                           (c, SamplingParams(max_new_tokens=1)), (c[:32] + a, SamplingParams(max_new_tokens=1)),
                           (b, SamplingParams(max_new_tokens=1, prompt_logprobs=1))]:
        seq = engine.new_sequence(prompt, params)
        engine.admit(seq)
        engine.prefill(seq)
        engine.release(seq)
    assert spmd_forward._cache_size() == compiled
