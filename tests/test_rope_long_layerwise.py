"""The layer-wise prefill of a prompt long enough for RoPE's materialised cos/sin table (one program per layer,
each with its own table) against the engine's plain prefill (one program, one table shared by the layers): the
same tokens, logits and KV to bfloat16 precision, and bit for bit between the stored and float-stored caches, as
``test_kv_storage`` checks for short prompts (whose tables stay fused)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import jax.numpy as jnp

from mooncake_jax.llm import build_model
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.rope import MATERIALISED_TABLE_MIN_TOKENS

from test_kv_storage import bits, float_storage, layerwise, plain_prefill


@pytest.fixture(scope="module")
def long_engines():
    model = build_model("tiny", dtype="bfloat16")
    engines = []
    for reference in (False, True):
        with float_storage() if reference else contextlib.nullcontext():
            engines.append(Engine(model, prefill_chunk_size=256, num_pages=48))
    return engines


def test_long_layerwise_prefill_equals_the_float_stored_one_and_plain(long_engines):
    t = MATERIALISED_TABLE_MIN_TOKENS + 40
    prompt = [5 + (i * 7) % 490 for i in range(t)]
    got, want = (layerwise(engine, prompt) for engine in long_engines)
    assert bits(got[0]) == bits(want[0]) and bits(got[1]) == bits(want[1]) and got[2] == want[2]
    logits, blocks, output = plain_prefill(long_engines[0], prompt)
    assert output == got[2]
    np.testing.assert_allclose(np.asarray(got[0], np.float32), logits, rtol=0, atol=2e-2 * np.abs(logits).max())
    # bfloat16 KV of two differently fused programs over 168 tokens: main's tree too has two of 45,056 elements
    # 0.024-0.028 apart (both forms of the table give the same); a wrong rotation would be off by order 1.
    np.testing.assert_allclose(got[1].astype(np.float32), blocks.astype(np.float32), rtol=2e-2, atol=5e-2)
    assert got[1].dtype == jnp.dtype(jnp.bfloat16)
