"""One context-table width per step kind (xla attention): the widths by hand, warm-up compiling exactly the
hand-counted program set, and a warmed engine serving contexts that span several former power-of-two widths with
no compile at all, its tokens equal to the float64 reference's."""

import numpy as np
import pytest

from mooncake_jax.engine.scheduler import Scheduler
from mooncake_jax.model.config import get_config
from mooncake_jax.model.engine import Engine, _prompt_rows, _sample_rows
from mooncake_jax.model.llama import init_model
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.model.steps import forward_step, read_blocks, write_blocks
from compile_count import CompileCount
from reference_model import random_prompts, reference_for, reference_greedy

MAX_SEQ = 112  # 7 pages of 16: no power of two, and a length no other test's engine has (its programs are its own)


@pytest.fixture(scope="module")
def model():
    return init_model(get_config("tiny").replace(max_seq_len=MAX_SEQ), 0)


def test_widths_by_hand(model):
    engine = Engine(model, prefill_chunk_size=16, bucket_factor=4, max_batch=4)
    assert engine.max_pages_per_seq == 7
    assert [engine.context_width(p) for p in range(9)] == [0] + [7] * 8
    assert engine.context_widths() == [7]
    pallas = Engine(init_model(model.cfg.replace(attention="pallas"), 0), prefill_chunk_size=16, max_batch=4)
    # the kernels' cost grows with the table width: powers of two >= the pages held, capped at the longest sequence
    assert [pallas.context_width(p) for p in range(9)] == [0, 1, 2, 4, 4, 7, 7, 7, 7]
    assert pallas.context_widths() == [1, 2, 4, 7]


def test_warmup_compiles_exactly_the_hand_counted_set(model):
    """Chunks of 16 (one chunk bucket), batches 1/2/4, one context width of 7 pages. Step programs: prefill chunk 16
    without and with context (2), decode at batches 1, 2, 4 (3), every-position prefill without and with context
    (2): 7 (main's power-of-two widths 1, 2, 4, 7 gave 5 + 12 + 5 = 22). Helpers: the every-position log-softmax of
    chunk 16 and its last-row sampling (one each); block moves of 1, 2, 4, 8 pages, a read and a write each (8)."""
    engine = Engine(model, prefill_chunk_size=16, bucket_factor=4, max_batch=4)
    programs = (forward_step, _prompt_rows, _sample_rows, read_blocks, write_blocks)
    for f in programs:  # counted from empty: an earlier test of the session may have compiled some of the shapes
        f.clear_cache()
    assert engine.warmup() == 7 + 2 + 8
    assert [f._cache_size() for f in programs] == [7, 1, 1, 4, 4]


def test_a_warmed_engine_serves_contexts_of_every_former_width_without_compiling(model):
    """Prompts whose chunks and decode steps see contexts of 1 to 7 pages (the former widths 1, 2, 4 and 7), in
    batches of 1 to 4, one of them over a cached prefix, and a prompt-logprobs request: nothing compiles, and the
    greedy tokens are the float64 reference's."""
    engine = Engine(model, prefill_chunk_size=16, bucket_factor=4, max_batch=4)
    engine.warmup()
    ref = reference_for(model)
    prompts = random_prompts([3, 20, 40, 70, 95], seed=15)
    prompts.append(prompts[3][:48] + random_prompts([9], seed=16)[0])  # 3 cached pages, then 3 and 4 of context
    new = [12, 30, 12, 20, 12, 10]
    sched = Scheduler(engine)
    with CompileCount() as compiles:
        seqs = [engine.new_sequence(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, new)]
        for s in seqs:
            sched.add_request(s)
        while sched.has_work:
            sched.step()
        scored = engine.new_sequence(prompts[2], SamplingParams(max_new_tokens=1, prompt_logprobs=1))
        sched.add_request(scored)
        while sched.has_work:
            sched.step()
    assert compiles.n == 0
    assert seqs[-1].cached_tokens == 48  # the prefix was reused: its chunks' context started at 3 pages
    for s, p, n in zip(seqs, prompts, new):
        assert s.output == reference_greedy(ref, p, n)
    expected = np.log(np.exp(ref(prompts[2])[:-1]) / np.exp(ref(prompts[2])[:-1]).sum(-1, keepdims=True))
    got = [lp for lp, _ in scored.prompt_logprobs]
    np.testing.assert_allclose(got, expected[np.arange(39), prompts[2][1:]], atol=2e-3)
    assert engine.pages_in_use == 0
