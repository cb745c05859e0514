"""Layer-wise prefill (prefix KV written per layer, new KV stored per layer through the engine's layer hooks) equals
serialized prefill equals the plain engine and the float64 reference: same logits, same first token, same stored
blocks, on one device and with tensor parallelism and CPP stages together. Pool I/O is the caller's: the test reads
the prefix from a pool, calls prefill, and puts the returned blocks."""

import jax
import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.model import steps
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.sharding import MeshLayout, MeshSpec
from mooncake_jax.transfer import BlockPool, BlockSpec
from mooncake_jax.transfer.offload import (LAYERWISE, SERIALIZED, LayerwisePrefill, pool_prefix, request_keys,
                                           to_host_async)
from reference_model import reference_for, reference_greedy

RTOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return mj.LLM("tiny").model


@pytest.fixture(scope="module")
def ref(model):
    return reference_for(model)


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def plain(model, prompt):
    """Full prefill on a plain single-device engine: (last logits, first token, blocks of every prompt page)."""
    engine = Engine(model, prefix_caching=False)
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
    engine.admit(seq)
    logits = engine.prefill(seq)
    return logits, seq.output[0], engine.read_blocks(seq.pages)


def engine_of(model, tensor, stages, scan):
    layout = None if tensor * stages == 1 else MeshLayout(model.cfg, MeshSpec(stages, tensor))
    # several chunks: loads and saves in different ones
    return Engine(model, layout=layout, prefill_chunk_size=16, scan_layers=scan)


@pytest.mark.parametrize("mode, tensor, stages, scan", [
    (LAYERWISE, 1, 1, False), pytest.param(LAYERWISE, 1, 1, True, marks=pytest.mark.slow),  # scanned: the 2-2 case
    pytest.param(LAYERWISE, 2, 2, False, marks=pytest.mark.slow), (LAYERWISE, 2, 2, True),
    (SERIALIZED, 1, 1, False), pytest.param(SERIALIZED, 2, 2, True, marks=pytest.mark.slow)])
def test_layerwise_equals_serialized_equals_plain(model, ref, mode, tensor, stages, scan):
    """``scan``: stages hold stacked layers (lax.scan, per-layer program slicing them) or unrolled ones."""
    if tensor * stages > len(jax.devices()):
        pytest.skip(f"needs {tensor * stages} devices")
    rng = np.random.default_rng(0)
    a = rng.integers(0, 512, 40).tolist()
    b = a[:32] + rng.integers(0, 512, 19).tolist()  # shares two full blocks with a
    pool = BlockPool(BlockSpec(model.cfg.block_shape(), np.float32))
    engine = engine_of(model, tensor, stages, scan)
    offload = LayerwisePrefill(engine, mode)
    for prompt, reused in ((a, 0), (b, 2)):
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=6))
        keys = request_keys(seq, 16)
        prefix = pool_prefix(pool, seq, 16)  # caller side: the prompt's leading blocks from the pool
        assert (0 if prefix is None else len(prefix)) == reused
        logits, new_blocks = offload.prefill(seq, prefix)
        assert isinstance(new_blocks, np.ndarray)
        assert new_blocks.shape == (len(keys) - reused,) + model.cfg.block_shape()
        pool.put_many(keys[reused:], new_blocks)
        want_logits, want_first, want_blocks = plain(model, prompt)
        assert seq.cached_tokens == reused * 16
        assert rel_err(logits, want_logits) <= RTOL
        assert rel_err(logits, ref(prompt)[-1]) <= RTOL
        assert seq.output[0] == want_first == int(np.argmax(ref(prompt)[-1]))
        got = np.stack(pool.get_many(keys))
        assert rel_err(got, want_blocks) <= RTOL  # the plain engine's KV, prefix and new blocks alike
        while not seq.finished:  # decoding reads the prefix KV the hooks wrote into the pages
            engine.decode([seq])
        assert seq.output == reference_greedy(ref, prompt, 6)
        engine.release(seq)
    assert len(pool) == 3 + 2  # a: 2 full blocks + tail; b: its third full block + tail (2 shared with a)


class Recorder:
    """Layer hooks that log their calls and hand out a fixed prefix."""

    def __init__(self, prefix):
        self.prefix, self.calls, self.saved = prefix, [], {}

    def wait_for_layer_load(self, layer):
        self.calls.append(("load", layer))
        return self.prefix[:, layer]

    def save_layer(self, layer, new_kv):
        self.calls.append(("save", layer))
        assert isinstance(new_kv, jax.Array)  # handed over on the device: the hook decides how to copy
        self.saved[layer] = np.asarray(new_kv)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
@pytest.mark.parametrize("scan", [False, True])
def test_hooks_run_between_layers_with_one_program_per_stage(model, scan):
    """With tensor=2 x stages=2: every layer loads (first chunk) before it saves (last chunk), in layer order and in
    the CPP schedule, the saved KV is the plain engine's, and each stage compiles one per-layer program for all its
    layers."""
    prompt = np.random.default_rng(1).integers(0, 512, 70).tolist()  # 3 prefix blocks + 2 new (one partial)
    _, _, want = plain(model, prompt)
    engine = engine_of(model, 2, 2, scan)
    program = steps.layer_step if scan else steps.layer_apply_step
    hooks = Recorder(want[:3])
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
    engine.admit(seq, cached_pages=[])
    seq.cached_tokens = seq.num_computed = 48
    before = program._cache_size()
    engine.prefill(seq, hooks=hooks)
    assert program._cache_size() - before <= 2  # one per stage (shardings differ), not one per layer
    loads = [layer for kind, layer in hooks.calls if kind == "load"]
    saves = [layer for kind, layer in hooks.calls if kind == "save"]
    assert loads == saves == [0, 1, 2, 3]  # each layer once, in order
    assert all(hooks.calls.index(("load", l)) < hooks.calls.index(("save", l)) for l in range(4))
    # CPP order with 2 chunks: stage 0 loads during chunk 0, saves during chunk 1 while stage 1 starts chunk 0
    assert hooks.calls == [("load", 0), ("load", 1), ("save", 0), ("save", 1),
                           ("load", 2), ("load", 3), ("save", 2), ("save", 3)]
    for layer in range(4):
        saved = hooks.saved[layer]
        assert saved.shape[1:] == (2, 16, 2, 16) and len(saved) >= 2  # padded to a bucket of pages
        assert rel_err(saved[:2], want[3:, layer]) <= RTOL


def test_host_copies_keep_their_sharding_in_pinned_host_memory():
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array(devices), ("tensor",))
    x = jax.device_put(np.arange(8.0).reshape(2, 4),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor")))
    host = to_host_async(x)
    if "pinned_host" in {m.kind for m in devices[0].addressable_memories()}:
        assert host.sharding.memory_kind == "pinned_host" and host.sharding.spec == x.sharding.spec
    assert np.array_equal(np.asarray(host), np.arange(8.0).reshape(2, 4))


def test_bad_input(model):
    engine = Engine(model, prefill_chunk_size=16)
    with pytest.raises(ValueError, match="unknown mode"):
        LayerwisePrefill(engine, "eager")
    offload = LayerwisePrefill(engine)
    prompt = list(range(33))
    with pytest.raises(ValueError, match="prefix blocks have shape"):
        offload.prefill(engine.new_sequence(prompt), np.zeros((1, 1, 2, 16, 2, 16), np.float32))
    with pytest.raises(ValueError, match="leave no prompt token"):
        offload.prefill(engine.new_sequence(prompt[:32]), np.zeros((2,) + model.cfg.block_shape(), np.float32))
    assert engine.pages_in_use == 0  # nothing admitted by the refused calls
