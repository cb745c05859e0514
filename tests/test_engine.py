"""The engine against the naive float64 reference: scoring, greedy decoding, prefix reuse, chunking, batching."""

import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.engine.scheduler import Scheduler
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.sequence import SamplingParams
from reference_model import random_prompts as prompts, reference_for, reference_greedy

RTOL = 1e-4


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def test_score_matches_reference_at_every_position(llm, ref):
    (p,) = prompts([45])
    logits = llm.score(p)
    assert logits.shape == (45, 512) and logits.dtype == np.float32
    assert rel_err(logits, ref(p)) <= RTOL


def test_greedy_generate_matches_reference_step_by_step(llm, ref):
    ps = prompts([7, 30])
    out = llm.generate(ps, max_new_tokens=10)
    for p, o in zip(ps, out):
        assert o == reference_greedy(ref, p, 10)


def test_prefill_on_cached_prefix_equals_full_prefill(llm, ref):
    (base,) = prompts([60], seed=1)
    engine = Engine(llm.model, prefill_chunk_size=64)
    first = engine.new_sequence(base, SamplingParams(max_new_tokens=1))
    engine.admit(first)
    engine.prefill(first)
    engine.release(first)
    second_prompt = base[:50] + prompts([9], seed=2)[0]
    second = engine.new_sequence(second_prompt, SamplingParams(max_new_tokens=1))
    engine.admit(second)
    assert second.cached_tokens == 48  # three full 16-token blocks reused, only 11 tokens computed
    logits = engine.prefill(second, all_logits=True)
    assert logits.shape == (11, 512)
    assert rel_err(logits, ref(second_prompt)[48:]) <= RTOL
    assert engine.prefix_cache.hits >= 3


@pytest.mark.parametrize("chunk", [16, 24, 70])
def test_chunked_prefill_equals_unchunked(llm, ref, chunk):
    (p,) = prompts([70], seed=3)
    engine = Engine(llm.model, prefill_chunk_size=chunk, prefix_caching=False)
    seq = engine.new_sequence(p, SamplingParams(max_new_tokens=1))
    engine.admit(seq)
    logits = engine.prefill(seq, all_logits=True)
    assert rel_err(logits, ref(p)) <= RTOL


# scanned (the GPU/TPU default) in -m slow: ~15 s of XLA:CPU compiling; scanned stages stay in the default suite
# (test_sharding.py's scanned tensor=2,stage=2 engine against the single device)
@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_scanned_and_unrolled_layers_match_reference(llm, ref, scan):
    """Both ways a stage runs its stacked layers (lax.scan, or unrolled with a buffer per layer) prefill in chunks
    over a cached prefix and decode like the reference."""
    (p,) = prompts([50], seed=11)
    engine = Engine(llm.model, prefill_chunk_size=16, scan_layers=scan)
    assert all(stage.scan == scan for stage in engine.runner.stages)
    first = engine.new_sequence(p[:40], SamplingParams(max_new_tokens=1))
    engine.admit(first)
    assert rel_err(engine.prefill(first, all_logits=True), ref(p[:40])) <= RTOL
    engine.release(first)
    seq = engine.new_sequence(p, SamplingParams(max_new_tokens=5))
    engine.admit(seq)
    assert seq.cached_tokens == 32
    engine.prefill(seq)
    while not seq.finished:
        engine.decode([seq])
    assert seq.output == reference_greedy(ref, p, 5)


def test_ragged_batch_equals_each_alone(llm):
    ps = prompts([3, 17, 33, 50], seed=4)
    together = llm.generate(ps, max_new_tokens=9)
    alone = [llm.generate([p], max_new_tokens=9)[0] for p in ps]
    assert together == alone


def test_sequences_join_mid_batch(llm, ref):
    ps = prompts([12, 25, 40], seed=5)
    engine = Engine(llm.model, prefill_chunk_size=64)
    sched = Scheduler(engine)
    a, b, c = (engine.new_sequence(p, SamplingParams(max_new_tokens=n)) for p, n in zip(ps, (12, 6, 8)))
    sched.add_request(a)
    for _ in range(4):
        sched.step()
    sched.add_request(b)
    sched.step()
    sched.add_request(c)
    while sched.has_work:
        sched.step()
    for seq, n in ((a, 12), (b, 6), (c, 8)):
        assert seq.finish_reason == "length"
        assert seq.output == reference_greedy(ref, seq.prompt, n)
    assert engine.pages_in_use == 0  # nothing leaked


def test_sampling_is_reproducible_and_batch_independent(llm):
    ps = prompts([5, 20], seed=6)
    kw = dict(max_new_tokens=12, temperature=0.9, seed=11)
    batched = llm.generate(ps, **kw)
    assert batched == llm.generate(ps, **kw)
    assert batched[1] == llm.generate([ps[1]], **kw)[0]
    assert batched != llm.generate(ps, **{**kw, "seed": 12})
    greedy = llm.generate(ps, max_new_tokens=12)
    assert llm.generate(ps, max_new_tokens=12, temperature=1.0, top_p=1e-6) == greedy  # nucleus of one token


def test_top_p_only_samples_inside_the_nucleus(llm, ref):
    (p,) = prompts([9], seed=7)
    probs = np.exp(ref(p)[-1] - ref(p)[-1].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[: np.searchsorted(np.cumsum(probs[order]), 0.5) + 1].tolist())
    firsts = {llm.generate([p], max_new_tokens=1, temperature=1.0, top_p=0.5, seed=s)[0][0] for s in range(24)}
    assert firsts <= nucleus and len(firsts) >= min(2, len(nucleus))


def test_stops_at_eos_and_includes_it(llm, ref):
    (p,) = prompts([10], seed=8)
    greedy = reference_greedy(ref, p, 6)
    eos = greedy[3]
    stop = greedy.index(eos)
    out = llm.generate([p], max_new_tokens=6, eos_token_id=eos)[0]
    assert out == greedy[: stop + 1]
    assert llm.generate([p], max_new_tokens=6, eos_token_id=eos, ignore_eos=True)[0] == greedy


def test_bfloat16_model_runs_close_to_float32():
    llm16 = mj.LLM("tiny", dtype="bfloat16")
    (p,) = prompts([20], seed=9)
    ref = reference_for(llm16.model)  # same weights (rounded to bf16), computed in float64
    logits = llm16.score(p)
    assert logits.dtype == np.float32
    assert rel_err(logits, ref(p)) <= 0.1
    assert len(llm16.generate([p], max_new_tokens=4)[0]) == 4


def test_kv_handed_to_another_engine_continues_exactly(llm, ref):
    """Prefill on one engine, move the whole prompt KV (full blocks and the partial tail) as blocks, decode on
    another: the disaggregated path at engine level."""
    from mooncake_jax.blocks import block_keys, tail_key

    (p,) = prompts([37], seed=10)  # two full blocks and a 5-token tail
    prefill = Engine(llm.model, prefill_chunk_size=64)
    decode = Engine(llm.model, prefill_chunk_size=64)
    seq = prefill.new_sequence(p, SamplingParams(max_new_tokens=8))
    prefill.admit(seq)
    prefill.prefill(seq)
    keys = block_keys(p, 16) + [tail_key(p, 16)]
    blocks = prefill.read_blocks(seq.pages)
    assert blocks.shape == (3, 4, 2, 16, 2, 16)
    pages = decode.load_blocks(keys, blocks)
    assert decode.load_blocks(keys[:2], blocks[:2]) == pages[:2]  # already cached: same pages, nothing rewritten
    moved = decode.new_sequence(p, SamplingParams(max_new_tokens=8))
    decode.adopt(moved, pages, seq.output[0])
    while not moved.finished:
        decode.decode([moved])
    assert moved.output == reference_greedy(ref, p, 8)
    decode.release(moved)
    assert decode.pages_in_use == 0


def test_loading_blocks_never_evicts_the_callers_own_prefix(llm):
    """A full cache must make room by evicting other blocks, not the cached part of the prefix being loaded."""
    engine = Engine(llm.model, num_pages=5, prefill_chunk_size=64)  # 4 usable pages
    blocks = np.random.default_rng(0).standard_normal((4,) + llm.config.block_shape()).astype(np.float32)
    engine.load_blocks([1, 2], blocks[:2])  # the request's first two blocks, cached earlier
    engine.load_blocks([7, 8], blocks[2:])  # someone else's, used more recently
    pages = engine.load_blocks([1, 2, 3], blocks[:3])  # needs one page: must evict 7 or 8, never 1 or 2
    assert None not in pages and len(set(pages)) == 3
    assert np.array_equal(engine.read_blocks(pages), blocks[:3])
    mine = engine.load_blocks([4], blocks[3:], protect=pages)  # protect: the caller's pages survive as well
    assert all(engine.prefix_cache.page_of(k) == p for k, p in zip([1, 2, 3], pages))
    assert mine[0] not in pages


def test_steps_do_not_rehash_the_model_graph(llm, monkeypatch):
    """jax.jit hashes static arguments on every call; the engine passes its NNX graphs hashed once
    (``steps.HashedGraph``), so serving steps never walk the GraphDef's node tree (0.2-0.6 ms a step when they
    did). Counted by wrapping ``GraphDef.__hash__``: engines built before and after share compiled programs."""
    from flax import nnx

    engine = Engine(llm.model, prefill_chunk_size=64)
    seqs = [engine.new_sequence(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts([9, 20])]
    for s in seqs:
        engine.admit(s)
        engine.prefill(s)
    engine.decode(seqs)  # compiles outside the count
    calls = []
    original = nnx.GraphDef.__hash__
    monkeypatch.setattr(nnx.GraphDef, "__hash__", lambda self: calls.append(1) or original(self))
    for _ in range(3):
        engine.decode(seqs)
    assert not calls
    twin = Engine(llm.model, prefill_chunk_size=64)  # hashes its graphs once, at construction
    assert calls and twin.runner.stages[0].graphdef == engine.runner.stages[0].graphdef
