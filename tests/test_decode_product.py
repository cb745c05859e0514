"""The decode copy's dense products (``llama.decode_product``): their values against float64, and the compiled
form that makes them fast on XLA:CPU, the weight as the dot's left-hand operand (docs/benchmarks/engine.md, AMD EPYC
decode twentieth pass)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mooncake_jax.model.attention import PagedBatch
from mooncake_jax.model.config import PRESETS
from mooncake_jax.model.kv_cache import allocate_kv
from mooncake_jax.model.llama import STREAMED_ROWS_MAX, Stage, decode_product, init_model
from reference_model import reference_for

B = 5  # decode rows: a size no weight dimension of ``tiny`` has, so a [B, K] operand is the activations


def test_decode_product_is_x_times_w_transposed():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 1, 48)).astype(np.float32)
    w = rng.standard_normal((40, 48)).astype(np.float32)
    y = jax.jit(decode_product)(x, w)
    assert y.shape == (3, 1, 40) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)
    many = rng.standard_normal((STREAMED_ROWS_MAX + 8, 48)).astype(np.float32)  # the plain form's rows
    np.testing.assert_allclose(np.asarray(jax.jit(decode_product)(many, w)), many.astype(np.float64) @ w.T,
                               rtol=1e-5, atol=1e-5)
    low = jax.jit(decode_product, static_argnums=2)(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), jnp.float32)
    assert low.dtype == jnp.float32
    exact = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64).T
    np.testing.assert_allclose(np.asarray(low), exact, rtol=1e-4, atol=1e-4)  # bfloat16 inputs, float32 sums


def test_the_weight_is_the_left_operand_up_to_the_row_limit_only():
    w = np.ones((40, 48), np.float32)
    for rows, streamed in ((5, True), (STREAMED_ROWS_MAX, True), (STREAMED_ROWS_MAX + 1, False)):
        hlo = jax.jit(decode_product).lower(np.ones((rows, 48), np.float32), w).compile().as_text()
        (lhs, rhs), = [d for d in _operand_shapes(hlo) if 40 in d[0] + d[1]]
        assert (lhs == (40, 48)) == streamed and (rhs == (40, 48)) != streamed, (rows, lhs, rhs)


def _operand_shapes(hlo: str):
    """(lhs shape, rhs shape) of every dot of a compiled module's text, each computation's names resolved."""
    dots = []
    for body in re.findall(r"\{\n(.*?)\n\}", hlo, re.S):
        shapes = dict(re.findall(r"(%\S+) = f32\[([\d,]*)\]", body))
        for lhs, rhs in re.findall(r"= f32\[[\d,]*\]\S* dot\((%[^,\s]+), (%[^,\s)]+)\)", body):
            dots.append((tuple(map(int, shapes[lhs].split(","))), tuple(map(int, shapes[rhs].split(",")))))
    return dots


def test_decode_step_streams_every_weight_as_the_left_operand():
    """Speed guard: in the compiled one-token step every dense product (q, k, v, o, gate, up, down per layer and
    the LM head) takes its weight [N, K] as the dot's left-hand operand and the [B, K] rows as the right-hand one.
    The other way round, YNNPACK transposes the whole weight into its tiles on every call (0.70-0.90x CPU time per
    product at B = 32 on the EPYC). The step's logits stay the float64 reference's."""
    cfg = PRESETS["tiny"]
    model = init_model(cfg, seed=5)
    stage = Stage(model, 0, cfg.n_layers, scan=False)
    graphdef, params = nnx.split(stage)
    rng = np.random.default_rng(2)
    prompts = rng.integers(0, cfg.vocab_size, (B, 20))
    kv = allocate_kv(cfg, 1 + 2 * B, n_layers=cfg.n_layers)
    slots = (cfg.block_size + np.arange(2 * B * cfg.block_size, dtype=np.int32)).reshape(B, 2 * cfg.block_size)
    pages = (1 + np.arange(2 * B, dtype=np.int32)).reshape(B, 2)

    def run(params, kv, tokens, positions, batch, index):
        return nnx.merge(graphdef, params)(tokens, positions, kv, batch, index)

    prefill = jax.jit(run)
    for i in range(B):  # each sequence's 19 prompt tokens into its own pages, one at a time
        one = PagedBatch(np.zeros((1, 0), np.int32), np.zeros(1, np.int32), slots[i:i + 1, :19])
        _, kv = prefill(params, kv, prompts[i:i + 1, :19].astype(np.int32), np.arange(19, dtype=np.int32)[None],
                        one, None)
    step = PagedBatch(pages, np.full(B, 19, np.int32), slots[:, 19:20])
    args = (params, kv, prompts[:, 19:].astype(np.int32), np.full((B, 1), 19, np.int32), step, np.zeros(B, np.int32))
    decode = jax.jit(run)
    dots = _operand_shapes(decode.lower(*args).compile().as_text())
    d, f, h, kvh, hd, v = cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    weights = {(h * hd, d), (kvh * hd, d), (d, h * hd), (f, d), (d, f), (v, d)}
    streamed = [(lhs, rhs) for lhs, rhs in dots if lhs in weights and rhs == (B, lhs[1])]
    packed = [(lhs, rhs) for lhs, rhs in dots if rhs in weights and lhs == (B, rhs[1])]
    assert not packed, f"weights as the right-hand operand: {packed}"
    assert len(streamed) == 7 * cfg.n_layers + 1, dots

    logits, _ = decode(*args)
    for i in range(B):
        ref = reference_for(model)(list(prompts[i]))[-1]
        np.testing.assert_allclose(np.asarray(logits[i], np.float64), ref, atol=2e-4, rtol=0)
