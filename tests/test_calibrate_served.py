"""A plain prefill instance calibrates what it serves (``instance/calibrate.py``): prompts as long as those it
serves, and each prefill with its new blocks read out for the pool. Its slowdown meter divides served compute by
these predictions; fitted to prompts of at most 512 tokens, the model under-predicted the demo's long prompts 2-2.6x
and the meter read that bias as a slow host (docs/benchmarks/demo.md, eleventh pass)."""

import types

import pytest

from mooncake_jax.conductor.accounting import prefill_work_s
from mooncake_jax.conductor.profile import costs_from_profile
from mooncake_jax.instance import calibrate as cal
from mooncake_jax.llm import build_model
from mooncake_jax.model.config import get_config
from mooncake_jax.model.engine import Engine


def bent_s(engine, prompt, prefix=0):
    """Hand-made cost that grows faster past 256 new tokens (a prompt of several chunks, each attending to a longer
    context): 2 ms a request, 10 us a new token, and 1e-8 s times the square of the new tokens past 256."""
    new = len(prompt) - prefix // engine.block_size * engine.block_size
    return 0.002 + 1e-5 * new + 1e-8 * max(0, new - 256) ** 2


@pytest.fixture
def fake_engine():
    return types.SimpleNamespace(cfg=get_config("tiny"), num_pages=8193, block_size=16, max_batch=32,
                                 prefill_chunk_size=512, bucket_factor=4)


def test_the_grid_reaches_the_long_prompts_served(monkeypatch, fake_engine):
    """Predictions for 1,024-3,072-token prompts follow the measured cost within 10% (with the grid of at most 512
    new tokens they came out 12%, 26% and 34% low: a fit cannot know a cost it never measured)."""
    monkeypatch.setattr(cal, "served_prefill_seconds", bent_s)
    monkeypatch.setattr(cal, "decode_step_seconds", lambda engine, rng, batch, context, **kw: 1e-3 + 1e-6 * batch)
    costs = costs_from_profile(cal.calibrate(fake_engine, "x", "tiny", 100000)).prefill
    for n in (1024, 2048, 3072):
        expected = bent_s(fake_engine, [0] * n)
        assert prefill_work_s(costs, n, 0) == pytest.approx(expected, rel=0.1), n
    assert max(n - p for n, p in cal.PREFILL_GRID) >= 2048


def test_the_grid_stays_within_a_small_engine(monkeypatch):
    """An engine with room for fewer tokens measures only the points that fit it."""
    engine = types.SimpleNamespace(cfg=get_config("tiny"), num_pages=129, block_size=16, max_batch=8,
                                   prefill_chunk_size=512, bucket_factor=4)
    seen = []

    def timer(engine, prompt, prefix=0):
        seen.append(len(prompt))
        return bent_s(engine, prompt, prefix)

    monkeypatch.setattr(cal, "served_prefill_seconds", timer)
    monkeypatch.setattr(cal, "decode_step_seconds", lambda engine, rng, batch, context, **kw: 1e-3)
    cal.calibrate(engine, "x", "tiny", 100000)
    assert seen and max(seen) <= 128 * 16 // 2


def test_served_prefill_seconds_reads_the_new_blocks_out(monkeypatch):
    """On a real engine: the timed prefill reads out the prompt's blocks after the cached prefix (as the prefill
    instance does for the pool: 64 cached tokens of 16-token pages leave pages 4-7 of a 128-token prompt), and
    leaves no page in use."""
    engine = Engine(build_model("tiny", dtype="float32", block_size=16, seed=0), num_pages=64, max_batch=4)
    read = []
    real = Engine.read_blocks

    def spy(self, pages):
        read.append(len(pages))
        return real(self, pages)

    monkeypatch.setattr(Engine, "read_blocks", spy)
    prompt = list(range(1, 129))
    assert cal.served_prefill_seconds(engine, prompt, 64) > 0
    assert cal.served_prefill_seconds(engine, prompt, 0) > 0
    assert read == [4, 8]
    assert engine.pages_in_use == 0
