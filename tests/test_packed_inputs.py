"""A step's host arrays packed into one buffer (``model.packed_inputs``, the default on GPU and TPU): the tree comes
back bit for bit inside jit, and an engine that packs generates what one that does not generates (the float64
reference's greedy tokens; sampling with every setting, logprobs included)."""

import jax
import jax.numpy as jnp
import numpy as np

from mooncake_jax.engine.scheduler import Scheduler
from mooncake_jax.model.attention import PagedBatch
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.packed_inputs import pack, unpack
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.model.steps import forward_step_packed
from reference_model import random_prompts as prompts, reference_greedy


def test_unpack_inside_jit_gives_back_every_leaf_bit_for_bit():
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    floats[0, 0], floats[1, 1] = np.nan, -0.0
    hidden = jnp.arange(6.0).reshape(2, 3)  # a device array: passed through, not packed
    tree = (np.array([[1, -2, 2**31 - 1]], np.int32), PagedBatch(np.zeros((2, 0), np.int32),
                                                               np.array([7, 8], np.int32), np.full((2, 1), -5, np.int32)),
            None, {"seed": np.array([2**32 - 1, 3], np.uint32), "f": floats, "want": np.array([True, False]),
                   "scalar": np.int32(9), "hidden": hidden})
    buffer, passed, packing = pack(tree)
    assert buffer.dtype == np.uint32 and buffer.size == 3 + 0 + 2 + 2 + 2 + 15 + 2 + 1
    assert len(passed) == 1 and passed[0] is hidden
    assert hash(pack(tree)[2]) == hash(packing) and pack(tree)[2] == packing  # one compiled program per layout
    out = jax.jit(unpack, static_argnums=2)(buffer, passed, packing)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))  # NaN and -0.0 bits too


def _generate(engine, params_list, prompt_list):
    sched = Scheduler(engine)
    seqs = [engine.new_sequence(p, params) for p, params in zip(prompt_list, params_list)]
    for seq in seqs:
        sched.add_request(seq)
    while sched.has_work:
        sched.step()
    return seqs


def test_an_engine_that_packs_generates_what_one_that_does_not(llm, ref):
    packed = Engine(llm.model, prefill_chunk_size=64, pack_inputs=True)
    plain = Engine(llm.model, prefill_chunk_size=64, pack_inputs=False)
    assert all(stage.pack_inputs for stage in packed.runner.stages)
    ps = prompts([6, 23, 70], seed=9)  # the last one prefills in two chunks
    settings = [SamplingParams(max_new_tokens=8),
                SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=40, min_p=0.01, seed=3,
                               repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                               logit_bias=((5, 2.0), (7, -1.0)), logprobs=3),
                SamplingParams(max_new_tokens=8, temperature=1.1, seed=4, logprobs=2)]
    before = forward_step_packed._cache_size()
    a, b = _generate(packed, settings, ps), _generate(plain, settings, ps)
    assert forward_step_packed._cache_size() > before  # the packed program did the work
    assert a[0].output == reference_greedy(ref, ps[0], 8)
    for x, y in zip(a, b):
        assert x.output == y.output
        np.testing.assert_allclose([lp for lp, _ in x.logprobs], [lp for lp, _ in y.logprobs], rtol=1e-5)
        assert [[i for i, _ in alts] for _, alts in x.logprobs] == [[i for i, _ in alts] for _, alts in y.logprobs]
    assert len(a[1].logprobs) == 8 and len(a[1].logprobs[0][1]) == 3
    # logits at every position: the step's logits_index is None (a subtree the packing keeps as None)
    scored = []
    for engine in (packed, plain):
        seq = engine.new_sequence(ps[1], SamplingParams(max_new_tokens=1))
        engine.admit(seq, cached_pages=[])  # every position computed, not its cached prefix
        scored.append(engine.prefill(seq, all_logits=True))
        engine.release(seq)
    assert scored[0].shape == (23, 512)
    np.testing.assert_array_equal(scored[0], scored[1])


def test_packed_inputs_reach_every_stage_of_a_sharded_pipeline(llm, ref):
    """Two stages of two tensor-parallel devices: the buffer is placed replicated on each stage's mesh and the
    second stage's input, the first one's hidden states on device, passes through unpacked."""
    from mooncake_jax.sharding.layout import MeshLayout
    from mooncake_jax.sharding.mesh import MeshSpec

    engine = Engine(llm.model, layout=MeshLayout(llm.model.cfg, MeshSpec(2, 2)), prefill_chunk_size=64,
                    pack_inputs=True)
    ps = prompts([9, 40], seed=10)
    seqs = _generate(engine, [SamplingParams(max_new_tokens=6)] * 2, ps)
    for p, seq in zip(ps, seqs):
        assert seq.output == reference_greedy(ref, p, 6)
