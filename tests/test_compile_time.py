"""Compile time kept out of a prefill instance's slowdown meter (demo --hetero refused every request, ninth pass):
the compile clock's arithmetic on hand-made spans, JAX's own events reaching it, the layer-wise prefill's programs
compiled by its warm-up, and a prefill instance whose first requests compile feeding its meter their compute only."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mooncake_jax.instance.compile_time import CompileClock, clock
from compile_count import CompileCount


def test_clock_sums_the_union_of_spans_clipped_to_the_window():
    c = CompileClock()  # not installed: fed by hand
    span = "/jax/core/compile/backend_compile_duration"
    c._on_span("/jax/core/compile/jaxpr_trace_duration", 10.0, 13.0)  # an outer trace ...
    c._on_span("/jax/core/compile/jaxpr_trace_duration", 11.0, 12.0)  # ... with a nested one inside: 3 s, not 4
    c._on_span(span, 13.5, 14.0)
    c._on_span("/jax/some/other_event", 14.0, 20.0)  # not a compile stage: ignored
    assert c.seconds(0.0, 100.0) == pytest.approx(3.5)
    assert c.seconds(12.5, 13.75) == pytest.approx(0.5 + 0.25)  # clipped at both ends
    assert c.seconds(20.0, 30.0) == 0.0
    other = []
    t = threading.Thread(target=lambda: other.append(c.seconds(0.0, 100.0)))
    t.start()
    t.join()
    assert other == [0.0]  # another thread's compiles are not this one's
    assert c.seconds(0.0, 100.0, thread=threading.get_ident()) == pytest.approx(3.5)


def test_clock_hears_jax_compiles_on_the_compiling_thread_only():
    c = clock()
    f = jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.5)  # a program no other test compiles
    x = jnp.ones((24, 24))
    x.block_until_ready()
    t0 = time.time()
    f(x).block_until_ready()
    first = time.time()
    assert 0.0 < c.seconds(t0, first) <= first - t0
    f(x).block_until_ready()
    assert c.seconds(first) == 0.0  # compiled once: the second call runs it
    done = []
    t = threading.Thread(target=lambda: done.append(jax.jit(lambda y: y * 3.25 - 1)(x).block_until_ready()))
    since = time.time()
    t.start()
    t.join()
    assert done and c.seconds(since) == 0.0  # that compile was the other thread's
    assert c.seconds(since, thread=t.ident) > 0.0


def test_layerwise_warmup_compiles_what_layerwise_prefills_run():
    """Prompts of one and several chunks, with and without a prefix handed in, after ``warm_layerwise``: nothing
    compiles. Before it, the first of them compiled (the programs a layer-wise prefill instance's first requests
    waited seconds for, on a 2-core host 10-19 s each)."""
    from mooncake_jax.llm import init_model
    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.engine import Engine
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.transfer.layerwise_warmup import layerwise_shapes, warm_layerwise
    from mooncake_jax.transfer.offload import LayerwisePrefill

    model = init_model(get_config("tiny").replace(max_seq_len=64), 0)  # 4 pages a sequence: few shapes
    engine = Engine(model, prefill_chunk_size=16, bucket_factor=4)
    # one chunk bucket, one context width (4 pages); loads of 1, 2, 4 prefix pages and saves of 1, 2, 4 new ones
    assert layerwise_shapes(engine) == [(16, 0, None, 1), (16, 4, 1, 2), (16, 4, 2, 4), (16, 4, 4, 4)]
    with CompileCount() as compiles:
        assert warm_layerwise(engine) == 4
    assert compiles.n > 0
    layerwise = LayerwisePrefill(engine)
    rng = np.random.default_rng(0)
    block = model.cfg.block_shape()
    with CompileCount() as compiles:
        for n, prefix in ((5, 0), (20, 1), (40, 0), (40, 2), (63, 3)):  # 40: three chunks; 63: 3 blocks loaded
            seq = engine.new_sequence(rng.integers(0, 512, n).tolist(), SamplingParams(max_new_tokens=1))
            blocks = rng.standard_normal((prefix, *block)).astype(np.float32) if prefix else None
            _, new = layerwise.prefill(seq, blocks)
            engine.release(seq)
            assert len(new) == -(-n // 16) - prefix
    assert compiles.n == 0


def test_prefill_instance_feeds_its_meter_compute_less_first_use_compiles(monkeypatch):
    """An unwarmed layer-wise prefill instance: its first request compiles the layer programs on the engine loop,
    the second (same length, no shared prefix) runs them. The meter gets each job's time less what that thread spent
    compiling, which JAX's own backend-compile events (the test's listener, on the engine thread) bound from below.
    Before the fix the first request's compile went in whole (in this test: 25.9 s recorded, 22.2 s of it compiling)."""
    import mooncake_jax as mj
    from mooncake_jax.instance import prefill as prefill_module
    from reference_model import random_prompts
    from tiny_profile import PROFILE

    recorded, jobs, compiling = [], [], []
    record, job = prefill_module.SlowdownMeter.record, prefill_module.PrefillService._prefill_job

    def recording(self, measured_s, predicted_s, *args, **kwargs):
        recorded.append(measured_s)
        return record(self, measured_s, predicted_s, *args, **kwargs)

    def timed(self, *args, **kwargs):
        compiling.append(0.0)
        t = time.perf_counter()
        try:
            return job(self, *args, **kwargs)
        finally:
            jobs.append(time.perf_counter() - t)

    def on_compile(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration" and threading.current_thread().name == \
                "engine-prefill-0" and compiling:
            compiling[-1] += duration

    monkeypatch.setattr(prefill_module.SlowdownMeter, "record", recording)
    monkeypatch.setattr(prefill_module.PrefillService, "_prefill_job", timed)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        # chunks of 48 (buckets 16, 48): a chunk no other test runs, so the first request's layer programs are its
        # own to compile whatever ran before in this process (every context shares one table width)
        with mj.Cluster.local("tiny", prefill=1, decode=1, layerwise=True, prefill_chunk_size=48, admission="none",
                              warmup=False, compile_cache=None, profile_json=PROFILE) as cluster:
            for prompt in random_prompts([100, 100], seed=11):  # one after the other
                assert len(cluster.generate([prompt], max_new_tokens=2)[0]) == 2
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert len(recorded) == len(jobs) == 2
    assert compiling[0] > 0.05 and compiling[1] == 0.0  # the first compiled, the second did not
    assert recorded[0] <= jobs[0] - compiling[0] + 0.01  # its compile time left out
    assert recorded[1] >= 0.9 * jobs[1] - 0.001  # nothing left out of a job that compiled nothing
