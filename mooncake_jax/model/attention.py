"""Attention over a paged KV cache: one seam, two implementations chosen by ``ModelConfig.attention``.

The model calls exactly two functions: ``write_pages`` (scatter the step's new K/V into their pages) and
``paged_attention(..., impl=...)``. A step brings T new tokens per sequence (T = 1 when decoding) that sit right
after the sequence's ``ctx_len`` cached tokens.

Cache layout (head-major, shared by both implementations and JAX's Pallas kernels): K and V are each
``[kv_heads, rows, block_size, head_dim]``. ``PagedBatch.page_table`` and ``write_slots`` hold *absolute* rows of
that array (a stacked, scanned cache adds ``layer * num_pages``; a per-layer cache uses the page number itself).
Row 0 (page 0 of every layer) is scratch: padded tokens write there and no sequence reads it as context. The
kv_heads axis is axis 0, so tensor parallelism splits the cache without touching the page axis.

``impl="xla"`` (portable; on CPU where the C++ kernels are not built), split in two parts whose softmax is merged
exactly:

- *local*: the new tokens themselves, causal, per query block of static size (long prefills skip the masked
  upper triangle block by block);
- *context*: the cached tokens, masked to ``ctx_len``; every new token sees all of them. Folded into the local
  part's running softmax chunk by chunk of pages (``_context_loop``, a ``while`` loop up to the longest real
  ``ctx_len``): the engine passes one table width per step kind (``Engine.context_width``), and the pages past
  the context are never gathered nor computed. Decode (T = 1, B sequences) takes its own path, see ``_decode_xla``.

``impl="pallas"``: kernels that read pages in place, never a gathered copy of the context. The new tokens' K/V
are already in their pages (``write_pages`` runs first), so both decode and prefill are *one* causal attention over
``ctx_len + T`` paged keys through an extended page table (``_extended_table``) — no merge with a local part:

- decode (T = 1): JAX's own kernels, ``jax.experimental.pallas.ops.gpu.paged_attention`` on GPU (and on CPU in
  interpret mode) and ``jax.experimental.pallas.ops.tpu.paged_attention`` on TPU;
- prefill (T > 1): ``_ragged_kernel`` below, a Pallas kernel in the style of JAX's GPU one whose query rows are
  (token, group member) pairs with a per-row causal limit. On TPU it is not used (its whole-head page block would
  not fit VMEM); TPU prefill falls back to the xla implementation.

On CPU the kernels run with ``interpret=True``; on GPU/TPU compiled (chosen by ``jax.default_backend()``).

``impl="cpu_kernel"``: C++ kernels for XLA:CPU (``model/cpu_kernel``, XLA FFI custom calls built at first use) that
read the pages in place on XLA's intra-op threads: decode, and prefill as one causal attention over ``ctx_len + T``
paged keys through the extended page table (as the pallas implementation); a float16 cache through the xla
implementation. ``impl="auto"`` (the default) is ``cpu_kernel`` on the CPU backend where the kernels build,
``pallas`` on a GPU of compute capability 9.0 or more (Hopper, where the kernels were measured) for a cache they
compile for (``pallas_fits``), else ``xla`` (``resolve_impl``).

Tensor parallelism: the xla implementation is plain jnp, partitioned by GSPMD from the operands' shardings (heads
sharded, page tables replicated). A Pallas call or a custom call is opaque to GSPMD, so the pallas and cpu_kernel
implementations run under ``jax.shard_map`` over the ``tensor`` axis of the *context mesh*
(``jax.sharding.get_abstract_mesh()``): the caller traces the step inside ``jax.set_mesh(stage_mesh)``
(``sharding.pipeline.StageRunner`` does). Each device
then attends its own kv heads (and their query groups) over its own shard of the pages. Without a context mesh,
or when the tensor axis does not divide kv_heads (the cache is then replicated), the kernel runs unsplit.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from . import cpu_kernel
from .config import ATTENTION_IMPLS
from .kv_scatter import as_logical, set_at

MASKED = -1e30
"""Score of a masked key: exp() of it underflows to exactly 0, and unlike -inf it never produces NaN."""

SCRATCH_PAGE = 0
"""Page that padded tokens write to; never allocated to a sequence."""

IMPLS = ATTENTION_IMPLS
"""Values of ``ModelConfig.attention``."""

TENSOR_AXIS = "tensor"
"""Mesh axis the kv heads (and the cache's axis 0) are split over (``sharding.mesh.TENSOR``)."""


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; allowed: {', '.join(IMPLS)}")
    return impl


class PagedBatch(NamedTuple):
    """Where a step's tokens read their context from and write their K/V to (all int32 device arrays)."""

    page_table: jax.Array  # [B, P] absolute cache rows holding each sequence's cached context, in order
    ctx_len: jax.Array  # [B] cached tokens before the first new token
    write_slots: jax.Array  # [B, T] flat slot (row * block_size + offset) for each new token's K/V


def query_block_size(t: int) -> int:
    """Static query block of the local causal part.

    Small blocks skip more of the masked upper triangle and keep each block's scores in cache (on a 2-core CPU,
    128-token blocks prefill 2048 tokens 25% faster than 512-token ones), but every block is unrolled into the
    program, so long chunks use at most 16 blocks.
    """
    return t if t <= 128 else max(128, -(-t // 16))


def write_pages(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter ``new`` [B, T, H, D] into ``pages`` [H, rows, bs, D] at flat ``slots`` [B, T] (always in bounds:
    padded tokens point into the scratch row).

    Indexed as (row, offset) rather than through a flattened view: XLA turns a one-row scatter into a flattened
    view into a dynamic-update-slice that copies the whole cache on CPU.
    """
    bs = pages.shape[2]
    flat_slots = slots.reshape(-1)
    rows = jnp.moveaxis(new.reshape((-1,) + new.shape[2:]), 1, 0)  # [H, B*T, D]
    return set_at(pages, (slice(None), flat_slots // bs, flat_slots % bs), rows, mode="promise_in_bounds")


def gather_context(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """The context keys (or values) of each sequence, head-major: [H, B, P * block_size, D].

    Gathers whole pages as rows of a 3-D view [H, rows, bs * D]: XLA:CPU copies contiguous rows several times
    faster than it gathers the same bytes from the 4-D array. ``pages`` may be a stored 16-bit cache
    (``kv_scatter``): the gathered rows are bitcast to their float dtype, never the whole cache.
    """
    b, p = page_table.shape
    h, n, bs, d = pages.shape
    # Page tables only hold allocated rows or the scratch row: promised in bounds, the gather is a plain copy
    # (jnp.take's default fills out-of-bounds rows with NaN: a bounds test and a select on every element copied).
    rows = pages.reshape(h, n, bs * d).at[:, page_table.reshape(-1)].get(mode="promise_in_bounds")
    return as_logical(rows.reshape(h, b, p * bs, d))


# ---- the xla implementation ------------------------------------------------------------------------------------

def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


class _Partial(NamedTuple):
    """Unnormalised softmax state of a block of query rows: running max ``m``, sum ``l`` (both broadcastable to
    ``acc`` after ``to_acc``) and weighted sum of values ``acc`` (float32)."""

    acc: jax.Array
    m: jax.Array
    l: jax.Array


def _first(s, values, weigh) -> _Partial:
    """The state after the first keys' scores ``s`` (float32, masked entries MASKED, at least one real key)."""
    m = s.max(axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    return _Partial(weigh(e.astype(values.dtype), values), m, e.sum(axis=-1, keepdims=True))


def _update(p: _Partial, s, values, weigh) -> _Partial:
    """Online softmax: fold more keys' scores ``s`` and their values into ``p``; exact (the state is rescaled to the
    new max). A row whose new keys are all masked keeps its state (its exp() terms are 0)."""
    m = jnp.maximum(p.m, s.max(axis=-1, keepdims=True))
    corr = jnp.exp(p.m - m)
    e = jnp.exp(s - m)
    l = corr * p.l + e.sum(axis=-1, keepdims=True)
    return _Partial(corr * p.acc + weigh(e.astype(values.dtype), values), m, l)


PREFILL_CONTEXT_CHUNK_TOKENS = 512
"""Context positions a prefill reads per loop iteration (``_context_loop``), rounded to whole pages."""


def _context_loop(k_pages, v_pages, batch: PagedBatch, state, fold):
    """Fold a prefill's cached context into ``state`` chunk by chunk (a ``while`` loop up to the longest real
    ``ctx_len``), as the decode path does: the page table is as wide as the engine's one width per step kind
    (``Engine.context_width``), but the pages past the context are never gathered nor computed.

    ``fold(state, k_c, v_c, valid)`` takes one chunk's gathered keys and values, head-major [H, B, C, D], and
    ``valid`` [B, C] (position < ctx_len). The gathered chunk is materialised (``optimization_barrier``) so that
    XLA:CPU does not fuse the gather into the products and emit a naive loop (see ``_decode_xla``).
    """
    bs = k_pages.shape[2]
    table, ctx_len = batch.page_table, batch.ctx_len
    chunk = min(max(1, PREFILL_CONTEXT_CHUNK_TOKENS // bs), table.shape[1])
    if table.shape[1] % chunk:
        table = jnp.pad(table, ((0, 0), (0, chunk - table.shape[1] % chunk)))  # scratch pages, masked
    n_chunks = (jnp.max(ctx_len) + chunk * bs - 1) // (chunk * bs)

    def body(carry):
        i, state = carry
        pages = jax.lax.dynamic_slice_in_dim(table, i * chunk, chunk, axis=1)  # [B, chunk]
        k_c, v_c = jax.lax.optimization_barrier((gather_context(k_pages, pages), gather_context(v_pages, pages)))
        valid = (i * chunk * bs + jnp.arange(chunk * bs))[None, :] < ctx_len[:, None]
        return i + 1, fold(state, k_c, v_c, valid)

    return jax.lax.while_loop(lambda c: c[0] < n_chunks, body, (jnp.int32(0), state))[1]


UNMASKED_MIN_KEYS = 512
"""A query block of the one-sequence local part with at least this many keys before it takes them in a product
of their own, unmasked (``_one_sequence``). On a 2-core AMD EPYC the 2,048-token prefill took 2.4-3.6% less CPU
time with every block split; at 512 tokens nothing (1.04 s either way) for 29% more compile time, hence the
threshold: chunks of 512 tokens or fewer keep the one masked product per block (docs/benchmarks/engine.md, AMD
EPYC prefill, eighteenth pass)."""


def _one_sequence(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch):
    """Attention of one sequence's T new tokens as plain 2-D matrix products per KV head.

    XLA:CPU runs a [T * q_per_kv, head_dim] x [head_dim, S] product two to three times faster than the same work
    as a dot with batch dimensions, and prefill (one sequence, many tokens) is where the attention FLOPs are.
    The local (causal) part runs first per (head, query block): the block's keys masked, or, past
    ``UNMASKED_MIN_KEYS``, its diagonal keys masked and the keys before it folded in unmasked (no select pass over
    their scores); the context, if any, is then folded in by ``_context_loop``.
    """
    _, t, hk, g, d = q.shape
    qb = query_block_size(t)
    blocks = [(j, start, min(start + qb, t)) for j in range(hk) for start in range(0, t, qb)]
    q_rows = [q[0, :, j].reshape(t * g, d) for j in range(hk)]  # rows are (token, group member)
    q_blks = [q_rows[j][start * g: end * g] for j, start, end in blocks]
    state = []
    for (j, start, end), q_blk in zip(blocks, q_blks):
        # The causal mask touches only the block's diagonal keys (start:end); from UNMASKED_MIN_KEYS keys before
        # the block on, those are folded in unmasked, so no select pass runs over the block's [rows, start] scores.
        rows = start + jnp.arange((end - start) * g) // g
        lo = start if start >= UNMASKED_MIN_KEYS else 0  # keys [lo:end] masked, [:lo] folded in unmasked
        s = _dot(q_blk, k_new[0, lo:end, j].T)
        p = _first(jnp.where(rows[:, None] >= jnp.arange(lo, end)[None, :], s, MASKED), v_new[0, lo:end, j], _dot)
        if lo:
            p = _update(p, _dot(q_blk, k_new[0, :lo, j].T), v_new[0, :lo, j], _dot)
        state.append(p)
    if batch.page_table.shape[1] > 0:
        def fold(state, k_c, v_c, valid):
            return [_update(p, jnp.where(valid, _dot(q_blk, k_c[j, 0].T), MASKED), v_c[j, 0], _dot)
                    for p, q_blk, (j, _, _) in zip(state, q_blks, blocks)]

        state = _context_loop(k_pages, v_pages, batch, state, fold)
    outs = [(p.acc / p.l).reshape(end - start, g, d) for p, (_, start, end) in zip(state, blocks)]
    n = len(outs) // hk
    heads = [outs[j * n] if n == 1 else jnp.concatenate(outs[j * n: (j + 1) * n], axis=0) for j in range(hk)]
    return jnp.stack(heads, axis=1)[None]


def _batched(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch):
    """Attention of B sequences' T > 1 new tokens with batched products; state laid out [B, K, G, Tb, ...]."""
    b, t, hk, g, d = q.shape
    qb = query_block_size(t)

    def weigh_loc(e, values):
        return jnp.einsum("bkgts,bskd->bkgtd", e, values, preferred_element_type=jnp.float32)

    def weigh_ctx(e, values):
        return jnp.einsum("bkgts,kbsd->bkgtd", e, values, preferred_element_type=jnp.float32)

    spans = [(start, min(start + qb, t)) for start in range(0, t, qb)]
    q_blks = [q[:, start:end] for start, end in spans]
    state = []
    for (start, end), q_blk in zip(spans, q_blks):
        s = jnp.einsum("btkgd,bskd->bkgts", q_blk, k_new[:, :end], preferred_element_type=jnp.float32)
        s = jnp.where(jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :], s, MASKED)
        state.append(_first(s, v_new[:, :end], weigh_loc))
    if batch.page_table.shape[1] > 0:
        def fold(state, k_c, v_c, valid):
            out = []
            for p, q_blk in zip(state, q_blks):
                s = jnp.einsum("btkgd,kbsd->bkgts", q_blk, k_c, preferred_element_type=jnp.float32)
                out.append(_update(p, jnp.where(valid[:, None, None, None, :], s, MASKED), v_c, weigh_ctx))
            return out

        state = _context_loop(k_pages, v_pages, batch, state, fold)
    outs = [jnp.transpose(p.acc / p.l, (0, 3, 1, 2, 4)) for p in state]  # [B, K, G, Tb, D] -> [B, Tb, K, G, D]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


DECODE_CHUNK_ROWS = 256
"""Sequence-pages the xla decode reads per loop iteration (batch x pages per chunk, 8 to ``DECODE_CHUNK_PAGES``
pages): at batch 32 and block size 16, 8 pages (128 tokens) of K and V, about 4 MiB for the small preset, which
stay in cache; small batches take longer chunks so that their loop runs few iterations."""

DECODE_CHUNK_PAGES = 16
"""The longest chunk (pages per sequence). The loop reads whole chunks up to the longest context, so a long chunk
wastes up to a chunk per sequence: at batch 8 the old 32-page chunk read 1,024 positions for a 530-token context
(two chunks, the second nearly all masked), 16 pages read 768 (decode step CPU time at batch 8 -20 to -30%, Intel
Xeon (207); docs/benchmarks/engine.md, Xeon decode tenth pass)."""


DECODE_TAIL_PAGES = 2
"""Pages per chunk of the decode loop's tail (``_decode_xla``): after the whole chunks, the rest of the longest
context is read in chunks this short, so the loop reads at most one page past the context instead of up to a whole
chunk less one. At batch 32 (8-page chunks) over 529-token contexts the loop read 40 pages per sequence for 34 of
context; with the tail 34 (12 layers of decode attention -7 to -15% CPU time, Intel Xeon (207); docs/benchmarks/
engine.md, Xeon decode sixteenth pass)."""


def _page_rows(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """The pages of ``page_table`` [B, P] as rows [H * B * P, bs * D] of the stored cache (not ``as_logical`` yet):
    a gather batched over the heads, which XLA:CPU lowers to one gather of whole bs * D rows, head after head, with
    no transpose (``gather_context``'s ``pages[:, rows]`` gathers [rows, H, bs * D] and transposes it)."""
    h, n, bs, d = pages.shape
    heads = jnp.arange(h, dtype=page_table.dtype)[:, None] * n
    index = (heads + page_table.reshape(1, -1)).reshape(-1)
    return pages.reshape(h * n, bs * d).at[index].get(mode="promise_in_bounds")


def _decode_gather(k_pages, v_pages, page_table, take: jax.Array):
    """The chunk's context keys and values [H, B, P * bs, D] for the decode loop, gathered as whole rows inside a
    ``lax.cond``.

    Why the conditional: the products read the rows as [H, B, S, D], and XLA:CPU fuses that reshape into the
    gather's fusion, whose loop then runs over 64-float rows that it copies with scalar loads and stores (about half
    of memcpy speed; the page gathers were half of the loop, docs/benchmarks/engine.md, EPYC decode eighteenth
    pass). A branch of a conditional is a computation of its own, so the fusion inside it keeps its
    [H * B * P, bs * D] root and copies whole rows with vector loads and stores; the reshape outside is a bitcast
    that the products read in place. ``take`` is always true in practice (the chunk's first page, >= 0), but
    not known to the compiler; the other branch gathers the same values the plain way, so the result does not
    depend on it.
    """
    b, p = page_table.shape
    h, _, bs, d = k_pages.shape

    def rows():
        return _page_rows(k_pages, page_table), _page_rows(v_pages, page_table)

    def plain():
        return tuple(pages.reshape(h, -1, bs * d)[:, page_table.reshape(-1)].reshape(h * b * p, bs * d)
                     for pages in (k_pages, v_pages))

    k_rows, v_rows = jax.lax.cond(take, rows, plain)
    return tuple(as_logical(r.reshape(h, b, p * bs, d)) for r in (k_rows, v_rows))


def _decode_xla(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch, tail_pages: int | None = None,
                chunk_pages: int | None = None):
    """Decode (T = 1) of B sequences: an online softmax over chunks of context pages, as many chunks as the
    longest sequence needs (a ``while`` loop), starting from the new token itself.

    The page table is the engine's one width (``Engine.context_width``: every page a sequence can hold); the
    loop reads only up to the longest context, and each chunk's gathered K/V (``DECODE_CHUNK_ROWS``) stays in
    cache between its gather and its two products. Within a chunk, measured on a 2-core EPYC (small preset, B = 32),
    each choice below is worth 2-10x:

    - the context is gathered as whole rows of bs * D values, never element-wise, inside a conditional
      (``_decode_gather``) so that the copy stays a 2-D row copy that XLA:CPU vectorises (12 layers of b32 decode
      attention -18% CPU time, AMD EPYC, nineteenth pass); being a conditional's result, the products read it
      materialised rather than fused into them: XLA:CPU otherwise fuses the gather into the dot and emits a naive
      loop instead of a library call (5-10x slower), and the softmax's exp is materialised for the same reason;
    - the keys are the scores' *left* operand, scores laid out [H, B, S, G] (S long, G = q_per_kv short): a
      [S, D] x [D, G] product per (head, sequence) instead of [G, D] x [D, S], which XLA:CPU runs several times
      slower; the weights are then transposed to [H, B, G, S] (small) for the weighted sum, a plain [G, S] x [S, D]
      product (the [S, G]-major form ran 4x slower).
    - the scores are transposed to [H, B, G, S] *before* the softmax (a loop fusion over 200 KiB), so its max, exp
      and sum run along the contiguous axis: over [H, B, S, G] (G = 3 minor) the max and sum were strided YNNPACK
      reductions and the exp a poorly vectorised loop, together a fifth of the loop's time (12 layers of b32
      decode attention -14 to -20% CPU time, AMD EPYC; docs/benchmarks/engine.md, EPYC decode eighteenth pass).
      The scores are materialised first: a transpose fused into the dot makes YNNPACK write [G, S] rows, the slow
      orientation again (2x the whole loop).

    After the whole chunks, a second loop of ``tail_pages``-page chunks (``DECODE_TAIL_PAGES`` by default; 0: none,
    the first loop then reads whole chunks past the longest context) reads the rest of the longest context.
    ``chunk_pages`` overrides the chunk the batch size picks (both are there for benchmarks/decode_attention_ab.py).
    """
    b, _, hk, g, d = q.shape
    bs = k_pages.shape[2]
    table = batch.page_table
    chunk = min(chunk_pages or max(8, min(DECODE_CHUNK_PAGES, DECODE_CHUNK_ROWS // b)), table.shape[1])
    if table.shape[1] % chunk:
        table = jnp.pad(table, ((0, 0), (0, chunk - table.shape[1] % chunk)))  # scratch pages, masked below
    q1 = jnp.transpose(q[:, 0], (1, 0, 2, 3))  # [H, B, G, D]
    ctx_len = batch.ctx_len
    # The new token (already written to its page, but not in the context table) seeds the running softmax.
    m = jnp.einsum("hbgd,bhd->hbg", q1, k_new[:, 0], preferred_element_type=jnp.float32)
    l = jnp.ones_like(m)
    acc = jnp.broadcast_to(jnp.transpose(v_new[:, 0], (1, 0, 2))[:, :, None].astype(jnp.float32), (hk, b, g, d))
    longest = jnp.max(ctx_len)
    tail_pages = DECODE_TAIL_PAGES if tail_pages is None else tail_pages
    if tail_pages < 0:
        raise ValueError(f"tail_pages must be >= 0 (0: no tail loop), got {tail_pages}")

    def fold(first_page, n_pages, m, l, acc):
        pages = jax.lax.dynamic_slice_in_dim(table, first_page, n_pages, axis=1)  # [B, n_pages]
        k_ctx, v_ctx = _decode_gather(k_pages, v_pages, pages, first_page >= 0)  # [H, B, S, D]
        s = jax.lax.optimization_barrier(
            jnp.einsum("hbtd,hbgd->hbtg", k_ctx, q1, preferred_element_type=jnp.float32))  # [H, B, S, G]
        pos = first_page * bs + jnp.arange(n_pages * bs)
        valid = (pos[None, :] < ctx_len[:, None])[None, :, None, :]  # [1, B, 1, S]
        s = jax.lax.optimization_barrier(jnp.where(valid, jnp.swapaxes(s, 2, 3), MASKED))  # [H, B, G, S]
        m_new = jnp.maximum(m, s.max(axis=3))
        e = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = corr * l + e.sum(axis=3)
        e = jax.lax.optimization_barrier(e.astype(v_ctx.dtype))
        acc = corr[..., None] * acc + jnp.einsum("hbgt,hbtd->hbgd", e, v_ctx, preferred_element_type=jnp.float32)
        return m_new, l, acc

    def loop(start_page, n_pages, n_iter, m, l, acc):
        """Fold ``n_iter`` chunks of ``n_pages`` pages from ``start_page`` on (a ``while`` loop)."""
        def body(carry):
            i, m, l, acc = carry
            return (i + 1, *fold(start_page + i * n_pages, n_pages, m, l, acc))

        return jax.lax.while_loop(lambda c: c[0] < n_iter, body, (jnp.int32(0), m, l, acc))[1:]

    if not tail_pages or tail_pages >= chunk:
        m, l, acc = loop(0, chunk, (longest + chunk * bs - 1) // (chunk * bs), m, l, acc)
    else:
        table = jnp.pad(table, ((0, 0), (0, tail_pages - 1)))  # the last tail chunk may pass the chunks' width
        whole = longest // (chunk * bs)  # whole chunks, then the rest of the longest context in short ones
        m, l, acc = loop(0, chunk, whole, m, l, acc)
        rest = longest - whole * chunk * bs
        m, l, acc = loop(whole * chunk, tail_pages, (rest + tail_pages * bs - 1) // (tail_pages * bs), m, l, acc)
    return jnp.transpose(acc / l[..., None], (1, 0, 2, 3))[:, None]


def _xla(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch):
    if q.shape[1] == 1 and batch.page_table.shape[1] > 0:
        return _decode_xla(q, k_new, v_new, k_pages, v_pages, batch)
    attend = _one_sequence if q.shape[0] == 1 else _batched
    return attend(q, k_new, v_new, k_pages, v_pages, batch)


# ---- the pallas implementation ---------------------------------------------------------------------------------

def _extended_table(batch: PagedBatch, block_size: int, t: int, width: int) -> jax.Array:
    """Page table [B, width] covering ``ctx_len + t`` tokens: the context pages, then the pages the new tokens were
    written to (taken from ``write_slots``), then scratch. A page that holds both the context's tail and the first
    new tokens comes from the page table (the same page the new tokens were written to)."""
    b, p = batch.page_table.shape
    j = jnp.arange(width)[None, :]
    first_pos = j * block_size  # position of each page's first token
    ctx = batch.ctx_len[:, None]
    from_table = jnp.take_along_axis(batch.page_table, jnp.clip(j, 0, max(p - 1, 0)), axis=1) if p else 0
    tok = first_pos - ctx  # index among the new tokens of the page's first token
    from_new = jnp.take_along_axis(batch.write_slots, jnp.clip(tok, 0, t - 1), axis=1) // block_size
    table = jnp.where(first_pos < ctx, from_table, jnp.where(tok < t, from_new, SCRATCH_PAGE))
    return table.astype(jnp.int32)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


PREFILL_BLOCK_ROWS = 64
"""Query rows ((token, group member) pairs) per program of the pallas prefill kernel: the grid's third axis walks
the rows in blocks of this many, so a long prefill is many small programs (a GPU's registers hold one block's
scores) and each reads keys only up to its own last token (the causal upper triangle is skipped block by block)."""


def _ragged_kernel(q_ref, k_ref, v_ref, table_ref, ctx_ref, o_ref, *, group: int, n_tokens: int,
                   pages_per_block: int):
    """One (sequence, kv head, block of query rows): the rows are (token, group member) pairs; row r sees keys at
    positions < ctx_len + r // group + 1 (causal over the new tokens, everything before them). Online softmax over
    blocks of ``pages_per_block`` pages, up to the last page the block's last row can see."""
    rows, d = q_ref.shape
    bs = k_ref.shape[-2]
    block_k = pages_per_block * bs
    ctx = ctx_ref[0]
    q = q_ref[...]
    first = pl.program_id(2) * rows
    token = jnp.minimum((first + jnp.arange(rows)) // group, n_tokens - 1)  # padded rows copy the last token's
    limit = ctx + token + 1
    last_token = jnp.minimum((first + rows - 1) // group, n_tokens - 1)
    n_blocks = (ctx + last_token + block_k) // block_k

    def body(i, carry):
        o, m, l = carry
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(block_k, d)
        v = v_ref[pages].reshape(block_k, d)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        pos = i * block_k + jnp.arange(block_k)
        s = jnp.where(pos[None, :] < limit[:, None], s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        corr = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new[:, None])
        l = corr * l + e.sum(axis=-1)
        o = corr[:, None] * o + jnp.dot(e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o, m_new, l

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, _, l = lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)


def _ragged_attention(q, k_pages, v_pages, table, ctx_len, interpret: bool, pages_per_block: int = 8):
    """Causal paged attention of q [B, T, H, G, D] over ``table`` [B, W] (W a multiple of pages_per_block),
    ``ctx_len + T`` keys per sequence, all read from the pages. Returns [B, T, H, G, D] float32."""
    b, t, hk, g, d = q.shape
    n_rows = t * g
    block = min(PREFILL_BLOCK_ROWS, _round_up(n_rows, 16))  # GPU dots want >= 16 rows
    rows = _round_up(n_rows, block)
    qr = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, hk, n_rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - n_rows), (0, 0)))
    n_pages = k_pages.shape[1]
    bs = k_pages.shape[2]
    kernel = functools.partial(_ragged_kernel, group=g, n_tokens=t, pages_per_block=pages_per_block)
    out = pl.pallas_call(
        kernel,
        grid=(b, hk, rows // block),
        in_specs=[
            pl.BlockSpec((None, None, block, d), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, n_pages, bs, d), lambda i, h, j: (h, 0, 0, 0)),
            pl.BlockSpec((None, n_pages, bs, d), lambda i, h, j: (h, 0, 0, 0)),
            pl.BlockSpec((None, table.shape[1]), lambda i, h, j: (i, 0)),
            pl.BlockSpec((None, 1), lambda i, h, j: (i, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block, d), lambda i, h, j: (i, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hk, rows, d), jnp.float32),
        interpret=interpret,
        name="ragged_paged_attention",
    )(qr, k_pages, v_pages, table, ctx_len[:, None])
    out = out[:, :, :n_rows].reshape(b, hk, t, g, d)
    return jnp.transpose(out, (0, 2, 1, 3, 4))


KERNEL_BLOCK_BYTES = 256
"""Bytes of one head-dim row times keys per compute block that the kernels stage per K and V block: 128 keys of a
16-bit cache, 64 of a float32 one. 128 keys of float32 at head dim 128, staged for Triton's pipeline, asked an H200
for 288 KiB of shared memory (227 KiB there)."""


def _pages_per_block(k_pages) -> int:
    """Pages per compute block of the kernels: a power of two of at most 8 pages (it divides the table width and the
    8-page partitions of JAX's decode kernel) holding up to ``KERNEL_BLOCK_BYTES / itemsize`` keys: 8 pages of 16
    tokens for a 16-bit cache, 4 for float32; at least one (``pallas_fits`` keeps a page within that on a GPU)."""
    pages = max(1, min(8, KERNEL_BLOCK_BYTES // k_pages.dtype.itemsize // k_pages.shape[2]))
    return 1 << (pages.bit_length() - 1)


def pallas_fits(head_dim: int, block_size: int, itemsize: int) -> bool:
    """Whether the kernels compile for these shapes on a GPU: a power-of-two head dim of 16-256 and power-of-two
    pages of at most one compute block (Triton's blocks are powers of two, its dots at least 16 wide; a bigger page
    is a bigger block than shared memory holds, e.g. the 512-token pages of the llama presets)."""
    power_of_two = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return (power_of_two(head_dim) and 16 <= head_dim <= 256 and power_of_two(block_size)
            and block_size <= KERNEL_BLOCK_BYTES // itemsize)


def _decode_kernel(q, k_pages, v_pages, table, lengths, backend: str):
    """JAX's own paged-attention kernel for one query token per sequence: q [B, H, G, D] -> [B, H, G, D] f32."""
    b, hk, g, d = q.shape
    qh = q.reshape(b, hk * g, d)  # query heads grouped by kv head, as both kernels expect
    width = table.shape[1]
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu import paged_attention as tpu_pa

        out = tpu_pa.paged_attention(qh, k_pages, v_pages, lengths, table,
                                     pages_per_compute_block=_pages_per_block(k_pages))
    else:
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa

        out = gpu_pa.paged_attention(qh, k_pages, v_pages, table, lengths, block_h=16,
                                     pages_per_compute_block=_pages_per_block(k_pages), k_splits=width // 8,
                                     interpret=backend == "cpu")
    return out.reshape(b, hk, g, d).astype(jnp.float32)


def _pallas_local(q, k_pages, v_pages, batch: PagedBatch, backend: str):
    """The pallas implementation on one device's heads (inside shard_map when tensor-parallel)."""
    b, t, hk, g, d = q.shape
    bs = k_pages.shape[2]
    need = batch.page_table.shape[1] + -(-t // bs) + 1  # pages that can hold ctx_len + t tokens
    width = max(8, 1 << (need - 1).bit_length())  # a power of two >= 8: whole compute blocks and k_splits
    table = _extended_table(batch, bs, t, width)
    if t == 1:
        return _decode_kernel(q[:, 0], k_pages, v_pages, table, batch.ctx_len + 1, backend)[:, None]
    return _ragged_attention(q, k_pages, v_pages, table, batch.ctx_len, interpret=backend == "cpu",
                             pages_per_block=_pages_per_block(k_pages))


def _tensor_mesh(n_kv_heads: int):
    """The context mesh if it splits kv heads over a ``tensor`` axis of more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or TENSOR_AXIS not in mesh.axis_names:
        return None
    n = mesh.shape[TENSOR_AXIS]
    return mesh if n > 1 and n_kv_heads % n == 0 else None


def _cache_shape(q, k_pages) -> tuple[int, int, int]:
    """(head dim, block size, itemsize) of a step's cache: what ``pallas_fits`` decides by."""
    return q.shape[-1], k_pages.shape[2], k_pages.dtype.itemsize


def _pallas(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch):
    backend = jax.default_backend()
    shape = _cache_shape(q, k_pages)
    if backend == "gpu" and not pallas_fits(*shape):
        raise ValueError(f"attention='pallas' does not compile on a GPU for head dim {shape[0]} and {shape[1]}-token "
                         f"pages of {shape[2]}-byte values: it needs a power-of-two head dim of 16-256 and "
                         f"power-of-two pages of at most {KERNEL_BLOCK_BYTES // shape[2]} tokens; use "
                         f"attention='auto' or 'xla', or smaller pages (block_size)")
    if backend == "tpu" and q.shape[1] > 1:
        return _xla(q, k_new, v_new, k_pages, v_pages, batch)  # see the module docstring
    # The kernels index the pages themselves: a stored 16-bit cache (CPU only, where they run interpreted for
    # tests) is bitcast whole here; on GPU and TPU the cache is stored as its float dtype and this is a no-op.
    k_pages, v_pages = as_logical(k_pages), as_logical(v_pages)
    local = functools.partial(_pallas_local, backend=backend)
    mesh = _tensor_mesh(k_pages.shape[0])
    if mesh is None:
        return local(q, k_pages, v_pages, batch)
    heads = P(None, None, TENSOR_AXIS)
    pages = P(TENSOR_AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, pages, pages, P()), out_specs=heads,
                         check_vma=False)(q, k_pages, v_pages, batch)


def _cpu_kernel_local(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch):
    """The cpu_kernel implementation on one device's heads (inside shard_map when tensor-parallel)."""
    if q.shape[1] == 1:
        return cpu_kernel.paged_decode(q[:, 0], k_new[:, 0], v_new[:, 0], k_pages, v_pages, batch.page_table,
                                       batch.ctx_len)[:, None]
    t, bs = q.shape[1], k_pages.shape[2]
    table = _extended_table(batch, bs, t, batch.page_table.shape[1] + -(-t // bs) + 1)
    return cpu_kernel.paged_prefill(q, k_pages, v_pages, table, batch.ctx_len)


def _cpu_kernel(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch):
    """Decode and prefill through the C++ kernels (``cpu_kernel``), split over the ``tensor`` axis like the pallas
    implementation; a float16 cache (which they do not read) through the xla implementation."""
    if jax.default_backend() != "cpu":
        raise ValueError(f"attention='cpu_kernel' runs on the CPU backend only (this one is "
                         f"{jax.default_backend()!r}); use 'auto', 'xla' or 'pallas'")
    if not cpu_kernel.reads(k_pages.dtype):
        return _xla(q, k_new, v_new, k_pages, v_pages, batch)
    mesh = _tensor_mesh(k_pages.shape[0])
    if mesh is None:
        return _cpu_kernel_local(q, k_new, v_new, k_pages, v_pages, batch)
    heads, pages = P(None, None, TENSOR_AXIS), P(TENSOR_AXIS)
    return jax.shard_map(_cpu_kernel_local, mesh=mesh, in_specs=(heads, heads, heads, pages, pages, P()),
                         out_specs=heads, check_vma=False)(q, k_new, v_new, k_pages, v_pages, batch)


PALLAS_GPU_MIN_CAPABILITY = 9.0
"""CUDA compute capability from which ``auto`` takes the Pallas kernels on a GPU: Hopper (H100, H200), with 227 KiB of
shared memory per block, where they were measured (an H200, twenty-third session: the kernel tests pass compiled, and
against xla the kernels gave prefill 0.84-0.85 of the matmul rate instead of 0.68-0.70 and decode 1.13-1.29x the
tokens/s; docs/benchmarks/engine.md). Older GPUs have less shared memory than the kernels' 128-key blocks may stage,
and were not measured: xla there, ``attention="pallas"`` to choose the kernels."""


GPU_DECODE_KERNEL = "jax.experimental.pallas.ops.gpu.paged_attention"
"""JAX's GPU paged-attention kernel, which the pallas decode calls: deprecated in JAX 0.11 (with Pallas' Triton
backend), so ``auto`` takes the kernels only while this JAX still has it."""


def _pallas_fits_this_gpu() -> bool:
    """Whether the default device is a CUDA GPU of compute capability >= ``PALLAS_GPU_MIN_CAPABILITY`` and this JAX
    still ships ``GPU_DECODE_KERNEL``."""
    try:
        capable = float(getattr(jax.devices()[0], "compute_capability", 0)) >= PALLAS_GPU_MIN_CAPABILITY
    except (TypeError, ValueError):  # a GPU backend that names its capability otherwise (ROCm)
        return False
    try:
        return capable and importlib.util.find_spec(GPU_DECODE_KERNEL) is not None
    except ModuleNotFoundError:  # a parent package gone
        return False


def resolve_impl(impl: str, cache_shape: tuple[int, int, int] | None = None) -> str:
    """The implementation ``impl`` stands for on this backend: ``auto`` is the C++ kernels on CPU where they build
    (else xla, with the reason logged once), the Pallas kernels on a Hopper-class GPU (``PALLAS_GPU_MIN_CAPABILITY``)
    for a cache they compile for (``cache_shape``: head dim, block size, itemsize; ``pallas_fits``), xla elsewhere and
    inside a manual (``shard_map``) region such as the SPMD pipeline's stages, where the kernels' own split over the
    tensor axis is not wired."""
    check_impl(impl)
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if jax.sharding.get_abstract_mesh().manual_axes:
        return "xla"
    if backend == "gpu":
        fits = cache_shape is not None and pallas_fits(*cache_shape)
        return "pallas" if fits and _pallas_fits_this_gpu() else "xla"
    if backend != "cpu":
        return "xla"
    return "cpu_kernel" if cpu_kernel.available(log_failure=True) else "xla"


def paged_attention(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch, scale: float,
                    impl: str = "auto") -> jax.Array:
    """Attention output [B, T, kv_heads, q_per_kv, head_dim] (float32) of the new tokens.

    q [B, T, H, G, D]; k_new, v_new [B, T, H, D] (already written into the pages by ``write_pages``);
    k_pages, v_pages [H, rows, block_size, D]; ``impl`` one of ``IMPLS`` (static).
    """
    impl = resolve_impl(impl, _cache_shape(q, k_pages))
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    if impl == "pallas":
        return _pallas(q, k_new, v_new, k_pages, v_pages, batch)
    if impl == "cpu_kernel":
        return _cpu_kernel(q, k_new, v_new, k_pages, v_pages, batch)
    return _xla(q, k_new, v_new, k_pages, v_pages, batch)
