import numpy as np
import pytest

from mooncake_jax.blocks import block_keys, num_blocks, prefix_match, tail_key


def test_equal_prefixes_give_equal_keys_and_diverge_after():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, 64)
    b = a.copy()
    b[40] += 1  # differs inside block 2 (block size 16)
    ka, kb = block_keys(a, 16), block_keys(b, 16)
    assert len(ka) == 4
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2] and ka[3] != kb[3]  # chaining: every later key differs too


def test_same_block_content_at_other_prefix_gets_other_key():
    blk = list(range(16))
    k1 = block_keys(blk + blk, 16)
    assert k1[0] != k1[1]


def test_only_full_blocks_get_keys_and_parent_extends():
    toks = list(range(50))
    keys = block_keys(toks, 16)
    assert len(keys) == 3
    assert block_keys(toks[32:], 16, parent=keys[1]) == keys[2:]
    assert block_keys([], 16) == []


def test_prefix_match_counts_leading_keys_only():
    keys = [1, 2, 3, 4]
    assert prefix_match(keys, {1, 2, 4}) == 2
    assert prefix_match(keys, {2, 3}) == 0
    assert prefix_match(keys, lambda k: k < 4) == 3


def test_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2], 0)
    with pytest.raises(ValueError, match="integers"):
        block_keys(np.array([1.5, 2.0]), 1)


def test_num_blocks():
    assert num_blocks(0, 16) == 0 and num_blocks(16, 16) == 1 and num_blocks(17, 16) == 2


def test_tail_key_names_the_partial_block_only():
    toks = list(range(40))
    assert tail_key(toks[:32], 16) is None
    k = tail_key(toks, 16)
    assert k is not None and k not in block_keys(toks, 16)
    assert tail_key(toks[:39] + [999], 16) != k  # tail content matters
    other = [7] + toks[1:]
    assert tail_key(other, 16) != k  # so does the prefix it hangs from
    assert tail_key(toks[:8], 16) != block_keys(toks[:8] * 2, 16)[0]
