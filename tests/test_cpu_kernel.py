"""The C++ paged-attention kernels for XLA:CPU (``model/cpu_kernel``, ``attention="cpu_kernel"`` and ``"auto"``) against
the float64 attention of test_attention.py (which also splits them over a tensor axis): float32 and bfloat16 caches,
bad tables refused with an error (never a crash), and what happens where they cannot be built."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.model import attention, cpu_kernel
from mooncake_jax.model.attention import PagedBatch, paged_attention
from mooncake_jax.model.kv_scatter import storage_dtype
from reference_model import reference_for, reference_greedy
from test_attention import case, run

HAS_COMPILER = any(shutil.which(c) for c in cpu_kernel.COMPILERS)
needs_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on PATH")


@needs_kernel
def test_the_kernel_builds_and_auto_picks_it_on_cpu():
    assert cpu_kernel.available(), cpu_kernel.unavailable_reason()
    assert attention.resolve_impl("auto") == "cpu_kernel"
    assert cpu_kernel.library_path().exists()


@needs_kernel
@pytest.mark.parametrize("ctx_lens", [[0, 4, 7, 8, 13], [5], [40, 0, 33], [64, 1]])
@pytest.mark.parametrize("table_width", [None, 20])
def test_decode_equals_float64_reference(ctx_lens, table_width):
    args, expected = case(ctx_lens, 1, seed=len(ctx_lens), table_width=table_width, pad_page=23)
    out = run("cpu_kernel", *args)  # the padding points at a NaN page: the kernel must never read it
    assert out.shape == expected.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_bfloat16_cache_stored_as_bits_equals_float64_reference():
    """A bfloat16 cache on CPU is stored as uint16 (kv_scatter); the kernel reads those bits in place."""
    (q, k_new, v_new, k_pages, v_pages, batch), expected = case([9, 0, 30], 1, seed=3, dtype=jnp.bfloat16)
    as_bits = lambda x: jax.lax.bitcast_convert_type(x, storage_dtype(jnp.bfloat16))
    out = run("cpu_kernel", q, k_new, v_new, as_bits(k_pages), as_bits(v_pages), batch)
    # The inputs are bfloat16 values (the reference sees the same ones), and the seam rounds the scaled queries to
    # bfloat16 for both implementations; from there the kernel computes in float32, so it lands nearer the float64
    # reference than the xla implementation, whose softmax weights are bfloat16.
    np.testing.assert_allclose(out, expected, rtol=2e-2, atol=2e-2)
    out_xla = run("xla", q, k_new, v_new, as_bits(k_pages), as_bits(v_pages), batch)
    assert np.abs(out - expected).max() < np.abs(out_xla - expected).max()


@needs_kernel
@pytest.mark.parametrize("ctx_lens, t", [
    ([0], 6),  # prefill without context
    ([8], 5),  # after a page-aligned context
    ([6], 7),  # new tokens start mid-page and cross page boundaries
    ([3, 0], 4),  # a batch of prefills
    ([0], 70),  # more than one query block (64 tokens) and key block (64 keys)
    ([21, 50], 75),  # a batch of long chunks after contexts: blocks that straddle the context's end
])
def test_prefill_equals_float64_reference(ctx_lens, t):
    args, expected = case(ctx_lens, t, seed=len(ctx_lens) * 10 + t, rows=96)
    jaxpr = str(jax.make_jaxpr(lambda *a: paged_attention(*a, scale=1.0, impl="cpu_kernel"))(*args))
    assert cpu_kernel.PREFILL in jaxpr and cpu_kernel.DECODE not in jaxpr
    out = run("cpu_kernel", *args)
    assert out.shape == expected.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 24])  # 64: the vector tiles only; 24: a tile and a remainder
def test_prefill_value_products_in_tiles_of_16_head_dims(head_dim, monkeypatch):
    """test_attention's head_dim (8) runs only the value products' scalar remainder."""
    import test_attention

    monkeypatch.setattr(test_attention, "D", head_dim)  # read by case() and run() when called
    args, expected = case([5, 40], 33, seed=head_dim, rows=64)
    np.testing.assert_allclose(run("cpu_kernel", *args), expected, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 20])  # 64: keys and values eight at a time; 20: one by one
@pytest.mark.parametrize("t", [1, 19])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pages_of_16_tokens(head_dim, t, dtype, monkeypatch):
    """test_attention's 4-token pages never hold eight keys; the engine's 16-token pages do (whole groups of eight,
    and a page's tail one by one), in both cache dtypes."""
    import test_attention

    monkeypatch.setattr(test_attention, "BS", 16)
    monkeypatch.setattr(test_attention, "D", head_dim)
    (q, k_new, v_new, k_pages, v_pages, batch), expected = case([5, 40, 13, 0, 37], t, seed=head_dim + t, rows=40,
                                                               dtype=dtype)
    if dtype == jnp.bfloat16:
        k_pages, v_pages = (jax.lax.bitcast_convert_type(x, storage_dtype(dtype)) for x in (k_pages, v_pages))
    out = run("cpu_kernel", q, k_new, v_new, k_pages, v_pages, batch)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


@needs_kernel
def test_float16_goes_through_the_xla_implementation():
    args, _ = case([5, 9], 1, seed=6)
    f16 = [x.astype(jnp.float16) for x in args[:5]]
    for step in (args, (*f16, args[5])):
        jaxpr = str(jax.make_jaxpr(lambda *a: paged_attention(*a, scale=1.0, impl="cpu_kernel"))(*step))
        assert (cpu_kernel.DECODE in jaxpr) == (step is args)


@needs_kernel
def test_a_page_table_row_outside_the_cache_is_an_error_not_a_crash():
    (q, k_new, v_new, k_pages, v_pages, batch), _ = case([9, 3], 1, seed=4)
    bad = PagedBatch(batch.page_table.at[0, 1].set(10_000), batch.ctx_len, batch.write_slots)
    f = jax.jit(lambda *a: paged_attention(*a, scale=1.0, impl="cpu_kernel"))
    with pytest.raises(Exception, match="page table row 10000 outside the cache's 24 rows"):
        np.asarray(f(q, k_new, v_new, k_pages, v_pages, bad))
    long = PagedBatch(batch.page_table, batch.ctx_len.at[1].set(999), batch.write_slots)
    with pytest.raises(Exception, match="ctx_len 999 outside"):
        np.asarray(f(q, k_new, v_new, k_pages, v_pages, long))


@needs_kernel
def test_kernel_model_generates_the_reference_greedy_tokens():
    llm = mj.LLM("tiny", attention="cpu_kernel", prefill_chunk_size=32)
    ref = reference_for(llm.model)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 37, 70)]
    out = llm.generate(prompts, max_new_tokens=6)
    for p, o in zip(prompts, out):
        assert o == reference_greedy(ref, p, 6)


def test_auto_falls_back_to_xla_with_the_reason_and_explicit_use_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernel, "_load", lambda: "RuntimeError: no C++ compiler on PATH")
    monkeypatch.setattr(cpu_kernel, "_warned", [])
    with caplog.at_level("WARNING", logger=cpu_kernel.__name__):
        assert attention.resolve_impl("auto") == "xla"
        assert attention.resolve_impl("auto") == "xla"
    assert [r.getMessage() for r in caplog.records].count(
        "the CPU paged-attention kernels are unavailable, attention runs on the xla implementation: "
        "RuntimeError: no C++ compiler on PATH") == 1
    args, expected = case([5, 9], 1, seed=6)
    np.testing.assert_allclose(run("auto", *args), expected, rtol=2e-5, atol=2e-5)
    with pytest.raises(RuntimeError, match="the CPU paged-attention kernels are unavailable: RuntimeError: no C"):
        run("cpu_kernel", *args)


def test_a_source_that_does_not_compile_reports_the_compilers_error(tmp_path, monkeypatch):
    if not HAS_COMPILER:
        with pytest.raises(RuntimeError, match="no C\\+\\+ compiler on PATH"):
            cpu_kernel._build(tmp_path / "k.so")
        return
    broken = tmp_path / "broken.cc"
    broken.write_text("int f( {\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="broken.cc.*failed:\n.*error"):
        cpu_kernel._build(tmp_path / "k.so")
    assert not (tmp_path / "k.so").exists() and list(tmp_path.iterdir()) == [broken]  # no half-written library


def test_the_library_name_changes_with_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_kernel.library_path()
    assert first.parent == tmp_path / "mooncake-jax" / "kernels"
    changed = tmp_path / "paged_attention.cc"
    changed.write_bytes(cpu_kernel.SOURCE.read_bytes() + b"// another version\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", changed)
    assert cpu_kernel.library_path() != first


@needs_kernel
def test_processes_starting_together_build_the_library_once(tmp_path):
    """Three processes with an empty kernel cache (a local cluster's first start): all get the kernels, and one
    library file is built (the others wait on the lock, then load it)."""
    import os
    import subprocess
    import sys

    code = ("from mooncake_jax.model import cpu_kernel as k; import os; "
            "print(k.available(), os.path.getmtime(k.library_path()))")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert [o[0] for o in outs] == ["True"] * 3
    assert len({o[1] for o in outs}) == 1  # the same file, written once
    built = list((tmp_path / "mooncake-jax" / "kernels").glob("*.so"))
    assert len(built) == 1 and built[0].name.startswith("paged_attention-")
