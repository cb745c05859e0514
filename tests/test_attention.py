"""The attention seam (the xla and pallas implementations; the C++ kernels in test_cpu_kernel.py) against a float64
numpy attention over paged KV, the kernels split over a tensor axis, and the pallas implementation through the whole
model (greedy tokens of the float64 reference LLaMA, tensor parallel)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.model import cpu_kernel
from mooncake_jax.model.attention import PagedBatch, paged_attention, write_pages
from mooncake_jax.model.config import PRESETS
from reference_model import reference_for, reference_greedy

BS, H, G, D = 4, 2, 3, 8  # block size, kv heads, queries per kv head (GQA), head dim
ROWS = 24  # cache rows; row 0 is scratch
KERNEL_SIZED = dict(bs=16, h=2, g=8, d=128)
"""Shapes a GPU kernel compiles for (dots of >= 16 rows and columns; the llama2-70b head dim and group): the
small shapes above run the kernels in interpret mode only, where any shape does."""


def numpy_attention(q, k_ctx, v_ctx, k_new, v_new, ctx_len, scale):
    """float64: each new token t of a sequence sees its ctx_len cached tokens and new tokens 0..t."""
    b, t = q.shape[:2]
    out = np.zeros(q.shape, np.float64)
    for i in range(b):
        keys = np.concatenate([k_ctx[i][: ctx_len[i]], k_new[i]], axis=0)  # [S, H, D]
        vals = np.concatenate([v_ctx[i][: ctx_len[i]], v_new[i]], axis=0)
        for tok in range(t):
            visible = ctx_len[i] + tok + 1
            for h in range(q.shape[2]):
                s = q[i, tok, h] @ keys[:visible, h].T * scale  # [G, visible]
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                out[i, tok, h] = p @ vals[:visible, h]
    return out


def case(ctx_lens, t, seed=0, rows=ROWS, dtype=jnp.float32, table_width=None, pad_page=0, bs=None, h=None, g=None,
         d=None):
    """A paged cache holding each sequence's context in scattered rows, and a step of ``t`` new tokens.

    The context page table is as wide as the longest context, or ``table_width`` pages (the engine pads it to a
    power of two) with the padding pointing at row ``pad_page`` (scratch page 0 by default). Inputs are rounded to
    ``dtype`` before the float64 reference sees them. ``bs``, ``h``, ``g``, ``d``: block size, kv heads, queries per kv
    head, head dim (by default this module's ``BS``, ``H``, ``G``, ``D``, read at the call: tests elsewhere patch
    them)."""
    bs, h, g, d = (BS if bs is None else bs), (H if h is None else h), (G if g is None else g), (D if d is None else d)
    rng = np.random.default_rng(seed)
    b = len(ctx_lens)
    width = max(1, max(-(-(c + t) // bs) for c in ctx_lens))
    free = [r for r in rng.permutation(np.arange(1, rows)) if r != pad_page]
    tables = np.zeros((b, width), np.int32)
    for i, c in enumerate(ctx_lens):
        n = -(-(c + t) // bs)
        tables[i, :n] = [free.pop() for _ in range(n)]
    rnd = lambda *shape: np.asarray(jnp.asarray(rng.standard_normal(shape), dtype), np.float64)
    k_pages, v_pages = rnd(h, rows, bs, d), rnd(h, rows, bs, d)
    k_ctx = np.zeros((b, width * bs, h, d))
    v_ctx = np.zeros((b, width * bs, h, d))
    for i, c in enumerate(ctx_lens):
        for pos in range(c):
            row, off = tables[i, pos // bs], pos % bs
            k_ctx[i, pos], v_ctx[i, pos] = k_pages[:, row, off], v_pages[:, row, off]
    q, k_new, v_new = rnd(b, t, h, g, d), rnd(b, t, h, d), rnd(b, t, h, d)
    slots = np.array([[tables[i, (c + j) // bs] * bs + (c + j) % bs for j in range(t)]
                      for i, c in enumerate(ctx_lens)], np.int32)
    # The page table covers the cached context only (as the engine builds it), padded with scratch page 0.
    ctx_width = max(-(-c // bs) for c in ctx_lens) if table_width is None else table_width
    ctx_table = np.full((b, ctx_width), pad_page, np.int32)
    for i, c in enumerate(ctx_lens):
        ctx_table[i, : -(-c // bs)] = tables[i, : -(-c // bs)]
    if pad_page:
        k_pages[:, pad_page] = v_pages[:, pad_page] = np.nan
    expected = numpy_attention(q, k_ctx, v_ctx, k_new, v_new, ctx_lens, 1 / np.sqrt(d))
    batch = PagedBatch(jnp.asarray(ctx_table), jnp.asarray(ctx_lens, jnp.int32), jnp.asarray(slots))
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(q), cast(k_new), cast(v_new), cast(k_pages), cast(v_pages), batch), expected


@jax.jit
def _write(k_pages, v_pages, k_new, v_new, slots):
    return write_pages(k_pages, k_new, slots), write_pages(v_pages, v_new, slots)


def run(impl, q, k_new, v_new, k_pages, v_pages, batch):
    """As the model calls the seam: write the new K/V first, then attend."""
    k_pages, v_pages = _write(k_pages, v_pages, k_new, v_new, batch.write_slots)
    f = jax.jit(lambda *a: paged_attention(*a, scale=1 / np.sqrt(q.shape[-1]), impl=impl))
    return np.asarray(f(q, k_new, v_new, k_pages, v_pages, batch))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("ctx_lens, t", [
    ([0, 4, 7, 8, 13], 1),  # decode: empty context, page-boundary lengths, partial last pages
    ([5], 1),
    ([40, 0, 33], 1),  # decode contexts longer than one 8-page chunk of the xla loop
    ([0], 6),  # prefill without context
    ([8], 5),  # prefill after a page-aligned context
    ([6], 7),  # new tokens start mid-page and cross page boundaries
    ([3, 0], 4),  # a batch of prefills
])
def test_paged_attention_equals_float64_reference(impl, ctx_lens, t):
    args, expected = case(ctx_lens, t, seed=len(ctx_lens) * 10 + t)
    out = run(impl, *args)
    assert out.shape == expected.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ctx_lens, t", [
    ([0, 17, 40, 300], 1),  # decode over several of the kernels' 8-page compute blocks
    ([0], 40),  # prefill: 320 query rows, five blocks of PREFILL_BLOCK_ROWS
    ([37], 70),  # nine blocks, the last one partial; new tokens start mid-page
    ([20, 0], 33),  # a batch of prefills
])
def test_kernel_sized_paged_attention_equals_float64_reference(impl, dtype, ctx_lens, t):
    """At shapes a GPU compiles (``KERNEL_SIZED``): on CPU the kernels run interpreted; on a GPU compiled, where
    float32 dots may round their inputs to TensorFloat-32 (hence the looser bound there). A bfloat16 cache rounds the
    softmax weights to bfloat16 before their product with the values."""
    args, expected = case(ctx_lens, t, seed=t + len(ctx_lens), rows=64, dtype=dtype, **KERNEL_SIZED)
    out = run(impl, *args)
    tol = 2e-2 if dtype == jnp.bfloat16 else (2e-5 if jax.default_backend() == "cpu" else 5e-3)
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


def test_xla_decode_loop_over_several_chunks_equals_reference(monkeypatch):
    """The xla decode reads the context in chunks of pages (a while loop up to the longest context): with 8-page
    chunks of 4-token pages (32 tokens) the 40-token context takes 2 iterations."""
    import mooncake_jax.model.attention as attention

    monkeypatch.setattr(attention, "DECODE_CHUNK_ROWS", 1)  # the minimum chunk: 8 pages of 4 tokens
    args, expected = case([40, 0, 33, 2], 1, seed=5)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tail", [0, 1, 2, 3, 4])
def test_xla_decode_tail_of_short_chunks_equals_reference(monkeypatch, tail):
    """After its whole 8-page chunks (32 tokens here) the decode loop reads the rest of the longest context in
    ``tail``-page chunks (0: none, whole chunks to the end): every split of the context gives the reference. The
    60-token context is 15 pages: a 3-page tail reads pages 8-16, past the table padded to whole chunks (16 pages),
    which the loop pads further with scratch pages (a dynamic slice past the end would be moved back onto real
    pages)."""
    import mooncake_jax.model.attention as attention

    monkeypatch.setattr(attention, "DECODE_CHUNK_ROWS", 1)  # the minimum chunk: 8 pages of 4 tokens
    args, expected = case([60, 0, 33, 2, 13], 1, seed=6, rows=48)
    k_pages, v_pages = _write(*args[3:5], *args[1:3], args[5].write_slots)
    f = jax.jit(lambda *a: attention._decode_xla(*a, tail_pages=tail))
    q = (args[0].astype(jnp.float32) / np.sqrt(D)).astype(args[0].dtype)
    out = np.asarray(f(q, args[1], args[2], k_pages, v_pages, args[5]))
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


def test_xla_decode_tail_reads_no_page_past_the_longest_context(monkeypatch):
    """The page table's padding points at a page of NaNs: whole 8-page chunks read it (37 tokens are 10 pages, the
    second chunk reaches page 16) and the NaN reaches the output through the weighted sum; a 1-page tail stops at
    page 10 and the output is the reference."""
    import mooncake_jax.model.attention as attention

    monkeypatch.setattr(attention, "DECODE_CHUNK_ROWS", 1)
    args, expected = case([37, 37], 1, seed=7, rows=40, table_width=24, pad_page=39)
    k_pages, v_pages = _write(*args[3:5], *args[1:3], args[5].write_slots)
    q = (args[0].astype(jnp.float32) / np.sqrt(D)).astype(args[0].dtype)

    def attend(tail):
        f = jax.jit(lambda *a: attention._decode_xla(*a, tail_pages=tail))
        return np.asarray(f(q, args[1], args[2], k_pages, v_pages, args[5]))

    assert np.isnan(attend(0)).all()
    np.testing.assert_allclose(attend(1), expected, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="tail_pages must be >= 0"):
        attend(-1)


def test_xla_decode_softmax_reduces_along_the_contiguous_axis():
    """Speed guard (AMD EPYC, docs/benchmarks/engine.md, eighteenth pass): the decode loop's scores are transposed
    to [H, B, G, S] before the softmax, so its max and sum reduce the minor axis; over [H, B, S, G] (G minor) they
    were strided YNNPACK reductions, with the exp a fifth of the loop. Every float reduction of the decode program
    (the loop's max and sum) must reduce only its operand's last axis, and the output stays the reference."""
    import re

    import mooncake_jax.model.attention as attention

    args, expected = case([40, 0, 33, 2], 1, seed=8)
    k_pages, v_pages = _write(*args[3:5], *args[1:3], args[5].write_slots)
    q = (args[0].astype(jnp.float32) / np.sqrt(D)).astype(args[0].dtype)
    f = jax.jit(attention._decode_xla)
    hlo = f.lower(q, args[1], args[2], k_pages, v_pages, args[5]).compiler_ir("hlo").as_hlo_text()
    # One axis reduced each: the operand's last one is the result's rank.
    reductions = re.findall(r"= f32\[([\d,]+)\]\S* reduce\([^)]*\), dimensions=\{([\d,]+)\}", hlo)
    assert len(reductions) >= 4  # max and sum in each of the two loops
    for shape, dims in reductions:
        assert dims == str(len(shape.split(","))), f"reduction over axes {{{dims}}} into f32[{shape}]"
    np.testing.assert_allclose(np.asarray(f(q, args[1], args[2], k_pages, v_pages, args[5])), expected,
                               rtol=2e-5, atol=2e-5)


def test_write_pages_puts_each_token_at_its_slot():
    (q, k_new, v_new, k_pages, v_pages, batch), _ = case([6, 0], 3, seed=3)
    written, _ = _write(k_pages, v_pages, k_new, v_new, batch.write_slots)
    written, before = np.asarray(written), np.asarray(k_pages)
    touched = np.zeros(written.shape[1:3], bool)
    for i in range(2):
        for j in range(3):
            row, off = divmod(int(batch.write_slots[i, j]), BS)
            np.testing.assert_array_equal(written[:, row, off], np.asarray(k_new[i, j]))
            touched[row, off] = True
    np.testing.assert_array_equal(written[:, ~touched], before[:, ~touched])  # nothing else moved


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown attention implementation 'cuda'"):
        PRESETS["tiny"].replace(attention="cuda")
    with pytest.raises(ValueError, match="unknown attention implementation"):
        mj.LLM("tiny", attention="flash")


@pytest.mark.parametrize("capability, expected", [("9.0", "pallas"), ("10.0", "pallas"), ("8.0", "xla"),
                                                  (None, "xla"), ("gfx90a", "xla")])
def test_auto_takes_the_pallas_kernels_on_hopper_gpus_only(monkeypatch, capability, expected):
    """``auto`` on a GPU: the kernels from compute capability 9.0 (where they were measured), xla on older CUDA GPUs,
    on a GPU that names its capability otherwise or not at all, and with a JAX that no longer has the GPU decode
    kernel; an explicit choice stays what it is."""
    import mooncake_jax.model.attention as attention

    device = type("FakeGpu", (), {} if capability is None else {"compute_capability": capability})()
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention.jax, "devices", lambda *a: [device])
    measured = (128, 16, 2)  # head dim, block size, itemsize: the shapes the H200 ran
    assert attention.resolve_impl("auto", measured) == expected
    assert attention.resolve_impl("auto") == "xla"  # shapes unknown
    assert attention.resolve_impl("xla") == "xla" and attention.resolve_impl("pallas") == "pallas"
    monkeypatch.setattr(attention, "GPU_DECODE_KERNEL", "jax.experimental.pallas.ops.gpu.gone_in_a_later_jax")
    assert attention.resolve_impl("auto", measured) == "xla"  # a JAX without the kernel: the portable path


@pytest.mark.parametrize("cache_shape, fits", [
    ((128, 16, 2), True), ((64, 16, 4), True), ((128, 128, 2), True), ((16, 8, 2), True),
    ((128, 512, 2), False),  # the llama presets' 512-token pages: one page is more than a compute block
    ((128, 128, 4), False), ((80, 16, 2), False), ((8, 16, 2), False), ((128, 24, 2), False)])
def test_pallas_fits_only_shapes_its_gpu_blocks_hold(cache_shape, fits):
    from mooncake_jax.model.attention import pallas_fits

    assert pallas_fits(*cache_shape) == fits


def test_pallas_on_a_gpu_refuses_pages_its_blocks_cannot_hold(monkeypatch):
    """An explicit ``pallas`` for a cache the GPU kernels cannot compile for: a clear error naming the fix, not
    XLA's shared-memory failure (traced only: the fake backend runs nothing)."""
    import mooncake_jax.model.attention as attention

    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    q = jax.ShapeDtypeStruct((1, 1, 2, 3, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((2, 8, 512, 128), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((1, 1, 2, 128), jnp.bfloat16)
    batch = PagedBatch(jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
                       jax.ShapeDtypeStruct((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="512-token pages .* at most 128 tokens; use attention='auto' or 'xla'"):
        jax.eval_shape(lambda *a: paged_attention(*a, scale=1.0, impl="pallas"), q, new, new, pages, pages, batch)


@pytest.fixture(scope="module")
def pallas_llm():
    return mj.LLM("tiny", attention="pallas", prefill_chunk_size=32)


@pytest.mark.slow  # the kernels are checked against the reference above; this runs them through a whole model
def test_pallas_model_generates_the_reference_greedy_tokens(pallas_llm):
    assert pallas_llm.config.attention == "pallas"
    ref = reference_for(pallas_llm.model)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 37)]  # the second one prefills in two chunks
    out = pallas_llm.generate(prompts, max_new_tokens=5)
    for p, o in zip(prompts, out):
        assert o == reference_greedy(ref, p, 5)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS in conftest.py)")
@pytest.mark.parametrize("impl", ["pallas", "cpu_kernel"])
@pytest.mark.parametrize("ctx_lens, t", [([0, 5, 8], 1), ([6], 7), ([0, 5, 8, 21], 1)])
def test_kernels_split_kv_heads_over_the_tensor_axis(impl, ctx_lens, t):
    """Under a context mesh with a tensor axis, the kernels (Pallas, or the C++ ones of ``cpu_kernel``) run per
    device on its own kv heads (shard_map), with the pages split on axis 0, and still equal the float64 reference."""
    if impl == "cpu_kernel" and not cpu_kernel.available():
        pytest.skip(f"the CPU kernels are not built here: {cpu_kernel.unavailable_reason()}")
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    (q, k_new, v_new, k_pages, v_pages, batch), expected = case(ctx_lens, t, seed=7)
    heads, pages = NamedSharding(mesh, P(None, None, "tensor")), NamedSharding(mesh, P("tensor"))
    q, k_new, v_new = (jax.device_put(x, heads) for x in (q, k_new, v_new))
    k_pages, v_pages = (jax.device_put(x, pages) for x in (k_pages, v_pages))
    with jax.set_mesh(mesh):
        k_pages, v_pages = _write(k_pages, v_pages, k_new, v_new, batch.write_slots)
        f = jax.jit(lambda *a: paged_attention(*a, scale=1 / np.sqrt(D), impl=impl))
        jaxpr = str(jax.make_jaxpr(f)(q, k_new, v_new, k_pages, v_pages, batch))
        assert "shard_map" in jaxpr
        assert impl == "pallas" or (cpu_kernel.DECODE if t == 1 else cpu_kernel.PREFILL) in jaxpr
        out = f(q, k_new, v_new, k_pages, v_pages, batch)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS in conftest.py)")
@pytest.mark.slow  # a whole model in interpret mode twice: ~30 s (suite budget)
def test_pallas_tensor_parallel_model_equals_single_device(pallas_llm):
    prompt = np.random.default_rng(2).integers(0, 512, 21).tolist()
    tp = mj.LLM("tiny", attention="pallas", tensor_parallel=2, prefill_chunk_size=32)
    assert tp.generate([prompt], max_new_tokens=3) == pallas_llm.generate([prompt], max_new_tokens=3)
