"""Layer-wise prefill (prefix KV loaded per layer from the pool, new KV stored per layer) equals serialized
prefill equals the plain engine: same logits, same first token, same stored blocks."""

import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.blocks import block_keys
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.transfer import BlockPool, BlockSpec
from mooncake_jax.transfer.offload import LAYERWISE, SERIALIZED, LayerwisePrefill, PerLayer, request_keys
from reference_model import reference_for, reference_greedy


@pytest.fixture(scope="module")
def model():
    return mj.LLM("tiny").model


def plain(model, prompt):
    """Full prefill on a plain engine: (last logits, first token, blocks of every prompt page)."""
    engine = Engine(model, prefix_caching=False)
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
    engine.admit(seq)
    logits = engine.prefill(seq)
    return logits, seq.output[0], engine.read_blocks(seq.pages)


@pytest.mark.parametrize("mode", [LAYERWISE, SERIALIZED])
def test_layerwise_equals_serialized_equals_plain(model, mode):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 512, 40).tolist()
    b = a[:32] + rng.integers(0, 512, 19).tolist()  # shares two full blocks with a
    pool = BlockPool(BlockSpec(model.cfg.block_shape(), np.float32))
    engine = Engine(model, layout=PerLayer(model.cfg), prefill_chunk_size=16)  # several chunks per layer
    offload = LayerwisePrefill(engine, pool, mode)
    for prompt, reused in ((a, 0), (b, 2)):
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=6))
        logits, stored = offload.prefill(seq)
        want_logits, want_first, want_blocks = plain(model, prompt)
        assert seq.cached_tokens == reused * 16
        assert np.max(np.abs(logits - want_logits)) <= 1e-4 * np.max(np.abs(want_logits))
        assert seq.output[0] == want_first
        keys = request_keys(seq, 16)
        assert stored == keys[reused:]
        got = np.stack(pool.get_many(keys))
        assert np.max(np.abs(got - want_blocks)) <= 1e-4 * np.max(np.abs(want_blocks))  # the plain KV
        while not seq.finished:
            engine.decode([seq])
        assert seq.output == reference_greedy(reference_for(model), prompt, 6)
        engine.release(seq)
    assert len(pool) == 3 + 2  # a: 2 full blocks + tail; b: its third full block + tail (2 shared with a)


def test_bad_setups(model):
    pool = BlockPool(BlockSpec(model.cfg.block_shape(), np.float32))
    with pytest.raises(ValueError, match="PerLayer"):
        LayerwisePrefill(Engine(model), pool)
    with pytest.raises(ValueError, match="unknown mode"):
        LayerwisePrefill(Engine(model, layout=PerLayer(model.cfg)), pool, "eager")
    other = BlockPool(BlockSpec((1, 2, 16, 2, 16), np.float32))
    with pytest.raises(ValueError, match="do not match"):
        LayerwisePrefill(Engine(model, layout=PerLayer(model.cfg)), other)
    assert block_keys([1] * 32, 16)  # keys are the shared block keys
