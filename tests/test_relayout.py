"""KV re-layout between unlike instances (transfer/relayout.py), against a per-token reference built by hand."""

import ml_dtypes
import numpy as np
import pytest

from mooncake_jax.kv_layout import KVLayout, exchange_problem
from mooncake_jax.transfer.relayout import convert, gather, relayout_pieces, split

L, H, D = 4, 2, 3


def layout(block=16, dtype="float32", tensor=1, stages=()):
    return KVLayout(n_layers=L, n_kv_heads=H, head_dim=D, block_size=block, dtype=dtype, tensor=tensor,
                    stage_layers=stages)


def token_kv(n_tokens, seed=0):
    """The KV every token position should end up with: kv[l, c, t, h, d], distinct everywhere."""
    return np.random.default_rng(seed).standard_normal((L, 2, n_tokens, H, D)).astype(np.float32)


def paged(kv, block):
    """Pages built one slot at a time (the reference; ``convert`` reshapes instead), unused slots zero."""
    n_tokens = kv.shape[2]
    pages = np.zeros((-(-n_tokens // block), L, 2, block, H, D), kv.dtype)
    for t in range(n_tokens):
        pages[t // block, :, :, t % block] = kv[:, :, t]
    return pages


@pytest.mark.parametrize("n_tokens", [1, 16, 33, 64, 70])
def test_16_to_32_token_pages_including_the_partial_tail(n_tokens):
    kv = token_kv(n_tokens)
    out = convert(paged(kv, 16), layout(16), layout(32), n_tokens)
    assert out.shape == (-(-n_tokens // 32), L, 2, 32, H, D)
    np.testing.assert_array_equal(out, paged(kv, 32))


def test_32_to_16_token_pages_and_garbage_past_the_prompt_is_dropped():
    kv = token_kv(40)
    pages = paged(kv, 32)
    pages[1, :, :, 8:] = 99.0  # slots past the 40th token: must not leak into the new pages
    out = convert(pages, layout(32), layout(16), 40)
    np.testing.assert_array_equal(out, paged(kv, 16))


def test_dtype_cast_both_ways():
    kv = token_kv(20)
    as_bf16 = convert(paged(kv, 16), layout(16), layout(32, "bfloat16"), 20)
    assert as_bf16.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(as_bf16, paged(kv.astype(ml_dtypes.bfloat16), 32))
    back = convert(as_bf16, layout(32, "bfloat16"), layout(16, "float32"), 20)
    assert back.dtype == np.float32
    np.testing.assert_allclose(back, paged(kv, 16), rtol=2 ** -8)


def test_heads_and_layers_regathered_from_another_split():
    kv = token_kv(30)
    src, dst = layout(16, tensor=2, stages=(2, 2)), layout(32, "bfloat16", tensor=4, stages=(1, 3))
    pieces = split(paged(kv, 16), src)
    assert pieces[(1, 1)].shape == (2, 2, 2, 16, 1, D)  # stage 1's layers 2-3, device 1's head 1
    np.testing.assert_array_equal(pieces[(1, 1)], paged(kv, 16)[:, 2:4, :, :, 1:2])
    out = relayout_pieces(pieces, src, dst, 30)
    assert sorted(out) == [(s, t) for s in range(2) for t in range(4)]
    assert out[(0, 3)].shape == (1, 1, 2, 32, 1, D)  # 4 devices over 2 KV heads: each holds one head
    expected = paged(kv.astype(ml_dtypes.bfloat16), 32)
    np.testing.assert_array_equal(out[(1, 2)], expected[:, 1:4, :, :, 1:2])
    np.testing.assert_array_equal(gather(out, dst), expected)


def test_bad_pieces_and_bad_blocks_are_named():
    src = layout(16, tensor=2)
    pieces = split(paged(token_kv(16), 16), src)
    del pieces[(0, 1)]
    with pytest.raises(ValueError, match="not those of"):
        gather(pieces, src)
    with pytest.raises(ValueError, match="shape"):
        convert(np.zeros((1, L, 2, 8, H, D), np.float32), layout(16), layout(32), 8)
    with pytest.raises(ValueError, match="do not fit"):
        convert(np.zeros((1, L, 2, 16, H, D), np.float32), layout(16), layout(32), 17)


def test_incompatible_models_are_named():
    other = KVLayout(n_layers=L, n_kv_heads=4, head_dim=D, block_size=16, dtype="float32")
    assert "KV heads differ: 2 vs 4" in exchange_problem(layout(), other)
    assert exchange_problem(layout(16, "float32", 2), layout(32, "bfloat16", 4, (1, 3))) is None
    with pytest.raises(ValueError, match="KV heads differ"):
        convert(paged(token_kv(4), 16), layout(), other, 4)


def test_layout_round_trips_through_json_and_refuses_bad_fields():
    lay = layout(32, "bfloat16", tensor=4, stages=(1, 3))
    assert KVLayout.from_json(lay.to_json()) == lay
    with pytest.raises(ValueError, match="dtype 'int8'"):
        layout(dtype="int8")
    with pytest.raises(ValueError, match="sum to the 4 layers"):
        layout(stages=(1, 2))
    with pytest.raises(ValueError, match="unknown KV layout field"):
        KVLayout.from_dict(lay.to_dict() | {"colour": 1})
