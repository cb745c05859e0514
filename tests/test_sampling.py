"""Top-p masking against a float64 numpy nucleus (sort, cumulative mass), ties and top_p = 1 included."""

import jax
import numpy as np
import pytest

from mooncake_jax.model.sampling import _top_p_mask


def numpy_nucleus(logits, top_p):
    """Kept tokens: the smallest prefix of the descending order with mass >= top_p, plus ties of its last."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    last = order[before < top_p][-1]
    return p >= p[last]


@pytest.mark.parametrize("top_p", [1e-6, 0.2, 0.5, 0.9, 0.99])
def test_top_p_mask_keeps_exactly_the_nucleus(top_p):
    rng = np.random.default_rng(int(top_p * 1000))
    logits = (rng.standard_normal((6, 300)) * 2).astype(np.float32)
    logits[1, :40] = logits[1, 0]  # a tie across the boundary keeps the whole tie
    mask = np.isfinite(np.asarray(jax.jit(_top_p_mask)(logits, np.full(6, top_p, np.float32))))
    for row in range(6):
        expected = numpy_nucleus(logits[row].astype(np.float64), top_p)
        assert (mask[row] == expected).all(), row


def test_top_p_of_one_keeps_every_token():
    logits = (np.random.default_rng(0).standard_normal((3, 5000)) * 8).astype(np.float32)
    masked = np.asarray(_top_p_mask(logits, np.array([1.0, 1.0, 0.5], np.float32)))
    assert np.isfinite(masked[:2]).all() and not np.isfinite(masked[2]).all()
