"""Traces: the bundled file's known facts, slicing, speed, the Poisson generator, prompts from block ids."""

import gzip
import json
import math

import numpy as np
import pytest

from mooncake_jax.blocks import block_keys
from mooncake_jax.sim.trace import Trace, TraceRequest, load_trace, poisson_trace, synthesize_prompt


def test_bundled_trace_matches_its_readme():
    trace = load_trace("conversation")
    assert len(trace) == 12031
    inputs = np.array([r.input_length for r in trace])
    assert inputs.mean() == pytest.approx(12035.1, abs=0.05)
    assert np.mean([r.output_length for r in trace]) == pytest.approx(342.6, abs=0.05)
    assert inputs.max() == 126195
    assert sum(len(r.hash_ids) for r in trace) == 288500
    assert len({h for r in trace for h in r.hash_ids}) == 182790
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in trace)
    assert isinstance(trace[0], TraceRequest) and trace[0].timestamp_s == 0.0


def test_slicing_window_and_speed():
    trace = load_trace("conversation")
    assert [r.timestamp_s for r in load_trace("conversation", first=5)] == [r.timestamp_s for r in trace[:5]]
    window = load_trace("conversation", start_s=600, end_s=1200)
    assert window and all(600 <= r.timestamp_s < 1200 for r in window)
    assert len(window) == sum(600 <= r.timestamp_s < 1200 for r in trace)
    fast = trace.first(100).with_speed(2.0)
    assert [r.timestamp_s for r in fast] == [r.timestamp_s / 2 for r in trace.first(100)]
    assert fast[7].hash_ids == trace[7].hash_ids


def test_loads_a_path_and_rejects_bad_input(tmp_path):
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 10, "output_length": 1, "hash_ids": [1]}]
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = load_trace(path)
    assert [r.timestamp_s for r in trace] == [0.0, 1.5] and trace[0].hash_ids == (1, 2)
    with pytest.raises(ValueError, match="unknown trace"):
        load_trace("no-such-trace")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="hash_ids"):
        load_trace(bad)
    for key in (-1, 2**64):  # outside the unsigned 64-bit keys the Conductor's index and the simulator hold
        bad.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [key]}) + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:1: hash_ids must be unsigned 64-bit.*got {key}"):
            load_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(bad)
    with pytest.raises(ValueError, match="sorted"):
        Trace([TraceRequest(1.0, 5, 1, (1,)), TraceRequest(0.0, 5, 1, (2,))])
    with pytest.raises(ValueError, match="speed"):
        trace.with_speed(0)
    with pytest.raises(ValueError):
        trace.first(-1)


def test_poisson_trace_rate_lengths_and_prefix_sharing():
    trace = poisson_trace(4.0, 4000, input_lengths=[1000, 3000], output_lengths=lambda rng, n: rng.integers(1, 9, n),
                          shared_prefix_tokens=1024, seed=1)
    gaps = np.diff([r.timestamp_s for r in trace])
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert {r.input_length for r in trace} == {1000, 3000}
    assert all(1 <= r.output_length <= 8 for r in trace)
    assert all(r.hash_ids[:2] == (0, 1) for r in trace)  # the shared 1024-token prefix: two common blocks
    tails = [h for r in trace for h in r.hash_ids[2:]]
    assert len(tails) == len(set(tails))  # the rest is unique
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in trace)
    with pytest.raises(ValueError):
        poisson_trace(0, 10, 100, 10)
    with pytest.raises(ValueError):
        poisson_trace(1.0, 10, [], 10)


def test_synthesize_prompt_turns_shared_ids_into_shared_prefixes():
    a = synthesize_prompt([7, 8, 9], 1500, block_tokens=16, vocab_size=1000, scale=32)
    b = synthesize_prompt([7, 8, 5], 1536, block_tokens=16, vocab_size=1000, scale=32)
    assert len(a) == math.ceil(1500 / 32) == 47 and len(b) == 48
    assert a[:32] == b[:32] and a[32:] != b[32:47]
    assert a[:16] == np.random.default_rng(7).integers(0, 1000, size=16).tolist()
    assert all(0 <= t < 1000 for t in a + b)
    # the engine's block keys then share exactly the trace's shared blocks
    ka, kb = block_keys(a, 16), block_keys(b, 16)
    assert ka[:2] == kb[:2] and ka[2:] != kb[2:]
    assert synthesize_prompt([3], 512, 512, 32000) == np.random.default_rng(3).integers(0, 32000, 512).tolist()
    with pytest.raises(ValueError):
        synthesize_prompt([1], 100, block_tokens=16, vocab_size=100, scale=2)  # 50 tokens, one 16-token block
    with pytest.raises(ValueError):
        synthesize_prompt([1], 10, block_tokens=16, vocab_size=0)
