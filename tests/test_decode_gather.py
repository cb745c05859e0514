"""The xla decode loop's page gather (``attention._decode_gather``): the values it hands the products, against a
brute-force gather and against the float64 reference attention, and the compiled form that makes it fast on CPU
(docs/benchmarks/engine.md, AMD EPYC decode nineteenth pass)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mooncake_jax.model import attention
from test_attention import BS, D, _write, case


def _brute_force(pages, table):
    """[H, B, P * BS, D] by loops over sequences and pages."""
    pages, table = np.asarray(pages), np.asarray(table)
    h, _, bs, d = pages.shape
    b, p = table.shape
    out = np.zeros((h, b, p * bs, d), pages.dtype)
    for i in range(b):
        for j in range(p):
            out[:, i, j * bs:(j + 1) * bs] = pages[:, table[i, j]]
    return out


@pytest.mark.parametrize("take", [True, False])
def test_both_branches_gather_the_pages_of_the_table(take):
    """Either branch of the conditional returns the table's pages in order, head-major: the result does not
    depend on the predicate (the decode loop always takes the first)."""
    rng = np.random.default_rng(4)
    k_pages = jnp.asarray(rng.standard_normal((3, 20, BS, D)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((3, 20, BS, D)), jnp.float32)
    table = jnp.asarray(rng.integers(0, 20, (5, 4)), jnp.int32)  # repeated and unordered rows included
    k, v = jax.jit(attention._decode_gather)(k_pages, v_pages, table, jnp.asarray(take))
    np.testing.assert_array_equal(np.asarray(k), _brute_force(k_pages, table))
    np.testing.assert_array_equal(np.asarray(v), _brute_force(v_pages, table))


def test_decode_gather_fusions_copy_whole_rows():
    """Speed guard: in the compiled decode program every gather fusion writes 2-D rows of BS * D values. A fusion
    whose root is the [H, B, S, D] view the products read (the reshape fused into the gather) copies D-value rows
    with scalar loads and stores at about half memcpy speed on XLA:CPU; the output stays the float64 reference."""
    args, expected = case([40, 0, 33, 2], 1, seed=8)
    k_pages, v_pages = _write(*args[3:5], *args[1:3], args[5].write_slots)
    q = (args[0].astype(jnp.float32) / np.sqrt(D)).astype(args[0].dtype)
    f = jax.jit(attention._decode_xla)
    compiled = f.lower(q, args[1], args[2], k_pages, v_pages, args[5]).compile().as_text()
    gathers = 0
    for name, body in re.findall(r"\n(%\S+) \([^\n]*\{\n(.*?)\n\}", compiled, re.S):
        if " gather(" not in body:
            continue
        gathers += 1
        root = re.search(r"ROOT %\S+ = f32\[([\d,]+)\]", body)
        assert root and root.group(1).split(",")[-1] == str(BS * D) and len(root.group(1).split(",")) == 2, \
            f"gather fusion {name} writes f32[{root.group(1) if root else '?'}], not rows of {BS * D} values"
    assert gathers >= 4  # K and V, in the loop of whole chunks and in the tail loop
    np.testing.assert_allclose(np.asarray(f(q, args[1], args[2], k_pages, v_pages, args[5])), expected,
                               rtol=2e-5, atol=2e-5)
