"""A layer-wise prefill instance calibrates the path it serves (``instance/calibrate.py``): the registered cost
model is fitted to layer-wise prefill times, not to the plain ``Engine.prefill`` that it never runs while serving
(``demo --hetero``'s layer-wise instances ran 1.4-3.6x over a model measured on the plain path)."""

import types

import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.conductor.accounting import prefill_work_s
from mooncake_jax.conductor.profile import costs_from_profile
from mooncake_jax.instance import calibrate as cal
from mooncake_jax.llm import build_model
from mooncake_jax.model.config import get_config
from mooncake_jax.model.engine import Engine
from mooncake_jax.transfer.offload import LayerwisePrefill
from tiny_profile import PROFILE


def plain_s(engine, prompt, prefix=0):  # hand-made costs: seconds per new token on each path
    return 1e-4 * (len(prompt) - prefix // engine.block_size * engine.block_size) + 0.002


def layerwise_s(engine, prompt, prefix=0):
    return 3e-4 * (len(prompt) - prefix // engine.block_size * engine.block_size) + 0.010


@pytest.mark.parametrize("layerwise, timer", [(False, plain_s), (True, layerwise_s)])
def test_the_profile_fits_the_path_calibrated(monkeypatch, layerwise, timer):
    """With hand-made timings for each path, the profile's predicted prefill at every grid point is that path's
    time (the other path's is 3x off)."""
    monkeypatch.setattr(cal, "served_prefill_seconds", plain_s)
    monkeypatch.setattr(cal, "layerwise_prefill_seconds", layerwise_s)
    monkeypatch.setattr(cal, "decode_step_seconds", lambda engine, rng, batch, context, **kw: 1e-3 + 1e-6 * batch)
    engine = types.SimpleNamespace(cfg=get_config("tiny"), num_pages=512, block_size=16, max_batch=16,
                                   prefill_chunk_size=512, bucket_factor=4)
    costs = costs_from_profile(cal.calibrate(engine, "x", "tiny", 100000, layerwise=layerwise)).prefill
    for n, prefix in cal.PREFILL_GRID:
        expected = timer(engine, [0] * n, prefix)
        assert prefill_work_s(costs, n, prefix) == pytest.approx(expected, rel=0.15), (n, prefix)
    wrong = plain_s if layerwise else layerwise_s
    assert prefill_work_s(costs, 512, 0) != pytest.approx(wrong(engine, [0] * 512), rel=0.5)


def test_layerwise_prefill_seconds_runs_the_layerwise_path_over_host_prefix_blocks(monkeypatch):
    """On a real engine: the timed prefill is ``LayerwisePrefill.prefill`` with the prefix as whole host blocks
    (64 cached tokens of 16-token pages: 4 blocks; a prefix past the last computable block is cut to what the
    prompt allows), and it leaves no page in use."""
    engine = Engine(build_model("tiny", dtype="float32", block_size=16, seed=0), num_pages=64, max_batch=4)
    seen = []
    real = LayerwisePrefill.prefill

    def spy(self, seq, prefix_blocks):
        seen.append(None if prefix_blocks is None else prefix_blocks.shape)
        return real(self, seq, prefix_blocks)

    monkeypatch.setattr(LayerwisePrefill, "prefill", spy)
    prompt = list(range(1, 129))
    for prefix in (0, 64, 70, 128):
        assert cal.layerwise_prefill_seconds(engine, prompt, prefix) > 0
        assert engine.pages_in_use == 0
    block = engine.cfg.block_shape()
    assert seen == [None, (4,) + block, (4,) + block, (7,) + block]  # 128 tokens: at most 7 blocks leave one


def test_a_layerwise_prefill_instance_calibrates_layerwise(monkeypatch):
    """The served cluster: with no profile given, the layer-wise prefill instance calibrates with ``layerwise``
    and the decode instance of the same engine without: two calibrations, not one shared profile."""
    from mooncake_jax.instance import server

    calls = []

    def fake(engine, name, model, capacity, repeats=2, layerwise=False):
        calls.append((name, layerwise))
        return PROFILE

    monkeypatch.setattr(server, "calibrate", fake)
    with mj.Cluster.local("tiny", prefill=2, decode=1, layerwise=True, warmup=False, compile_cache=None):
        pass
    assert sorted(calls) == [("decode-0", False), ("prefill-0", True)]
