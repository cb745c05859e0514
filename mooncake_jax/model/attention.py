"""Attention over a paged KV cache, in pure JAX (portable to CPU, GPU and TPU).

One code path serves prefill and decode. A step brings T new tokens per sequence (T = 1 when decoding) that sit
right after the sequence's ``ctx_len`` cached tokens. Their attention is split in two parts whose softmax is merged
exactly (shared max and denominator):

- *context*: the cached tokens, read from pages through the sequence's page table, masked to ``ctx_len``;
  every new token sees all of them;
- *local*: the new tokens themselves, causal. Computed per query block of static size, each block only against
  the keys up to its own end, so long prefills skip the masked upper triangle block by block.

The new tokens' K/V are scattered into their pages (``write_slots``) for later steps; padded tokens write into
the scratch page 0, which no sequence reads as context (page tables are padded with it, masked by ``ctx_len``).

Shapes: q [B, T, kv_heads, q_per_kv, head_dim]; k_new, v_new [B, T, kv_heads, head_dim];
k_pages, v_pages [kv_heads, rows, block_size, head_dim] (head-major, so the tensor-parallel KV-head axis leads; a
stage stacks its layers' pages as rows, layer l's page p at row l * num_pages + p, and the caller offsets the page
table and write slots to the layer's rows); page_table [B, P] int32 (absolute rows); ctx_len [B] int32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

MASKED = -1e30
"""Score of a masked key: exp() of it underflows to exactly 0, and unlike -inf it never produces NaN."""

SCRATCH_PAGE = 0
"""Page that padded tokens write to; never allocated to a sequence."""


class PagedBatch(NamedTuple):
    """Where a step's tokens read their context from and write their K/V to (all int32 device arrays)."""

    page_table: jax.Array  # [B, P] rows (pages) holding each sequence's cached context, in order
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
    padded tokens point into a scratch page).

    Indexed as (row, offset) rather than through a flattened view: XLA turns a one-row scatter into a
    flattened view into a dynamic-update-slice that copies the whole cache on CPU.
    """
    bs = pages.shape[2]
    flat_slots = slots.reshape(-1)
    rows = jnp.swapaxes(new.reshape((-1,) + new.shape[2:]), 0, 1).astype(pages.dtype)  # [H, B*T, D]
    return pages.at[:, flat_slots // bs, flat_slots % bs].set(rows, mode="promise_in_bounds")


def gather_context(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """The context keys (or values) of each sequence, head-major: [H, B, P * block_size, D].

    Gathers only the rows of the page table (never a whole layer), as rows of a 3-D view: XLA:CPU copies
    contiguous rows about 4x faster than it gathers the same bytes from the 4-D array.
    """
    b, p = page_table.shape
    h, n_rows, bs, d = pages.shape
    return pages.reshape(h, n_rows, bs * d)[:, page_table].reshape(h, b, p * bs, d)


def _softmax_combine(s_loc, s_ctx, values_loc, values_ctx, weigh, weigh_ctx=None):
    """Softmax over the local and context scores together (one max, one denominator), applied to their values.

    ``weigh(e, values)`` contracts weights with values for the layout at hand; scores are float32, masked entries
    are MASKED. Returns the normalised output in ``weigh``'s layout and the denominator broadcastable to it.
    """
    m = s_loc.max(axis=-1, keepdims=True)
    if s_ctx is not None:
        m = jnp.maximum(m, s_ctx.max(axis=-1, keepdims=True))
    e_loc = jnp.exp(s_loc - m)
    denom = e_loc.sum(axis=-1, keepdims=True)
    out = weigh(e_loc.astype(values_loc.dtype), values_loc)
    if s_ctx is not None:
        e_ctx = jnp.exp(s_ctx - m)
        denom = denom + e_ctx.sum(axis=-1, keepdims=True)
        out = out + (weigh_ctx or weigh)(e_ctx.astype(values_ctx.dtype), values_ctx)
    return out, denom


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _one_sequence(q, k_new, v_new, k_ctx, v_ctx, ctx_len):
    """Attention of one sequence's T new tokens as plain 2-D matrix products per KV head.

    XLA:CPU runs a [T * q_per_kv, head_dim] x [head_dim, S] product two to three times faster than the same work
    as a dot with batch dimensions, and prefill (one sequence, many tokens) is where the attention FLOPs are.
    """
    _, t, hk, g, d = q.shape
    qb = query_block_size(t)
    if k_ctx is not None:
        ctx_valid = (jnp.arange(k_ctx.shape[2]) < ctx_len[0])[None, :]
    heads = []
    for j in range(hk):
        qj, kj, vj = q[0, :, j].reshape(t * g, d), k_new[0, :, j], v_new[0, :, j]
        blocks = []
        for start in range(0, t, qb):
            end = min(start + qb, t)
            q_blk = qj[start * g: end * g]  # rows are (token, group member)
            rows = start + jnp.arange((end - start) * g) // g
            s_loc = jnp.where(rows[:, None] >= jnp.arange(end)[None, :], _dot(q_blk, kj[:end].T), MASKED)
            s_ctx = v_ctx_j = None
            if k_ctx is not None:
                s_ctx = jnp.where(ctx_valid, _dot(q_blk, k_ctx[j, 0].T), MASKED)
                v_ctx_j = v_ctx[j, 0]
            out, denom = _softmax_combine(s_loc, s_ctx, vj[:end], v_ctx_j, _dot)
            blocks.append((out / denom).reshape(end - start, g, d))
        heads.append(blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=0))
    return jnp.stack(heads, axis=1)[None]


def _batched(q, k_new, v_new, k_ctx, v_ctx, ctx_len):
    """Attention of B sequences' new tokens with batched products (decode: T = 1 per sequence)."""
    b, t, hk, g, d = q.shape
    qb = query_block_size(t)
    ctx_valid = None if k_ctx is None else (jnp.arange(k_ctx.shape[2])[None, :] < ctx_len[:, None])

    def weigh(e, values):
        return jnp.einsum("bkgts,bskd->btkgd", e, values, preferred_element_type=jnp.float32)

    def weigh_ctx(e, values):  # the context is head-major [K, B, S, D]
        return jnp.einsum("bkgts,kbsd->btkgd", e, values, preferred_element_type=jnp.float32)

    outs = []
    for start in range(0, t, qb):
        end = min(start + qb, t)
        q_blk = q[:, start:end]
        s_loc = jnp.einsum("btkgd,bskd->bkgts", q_blk, k_new[:, :end], preferred_element_type=jnp.float32)
        causal = jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :]
        s_loc = jnp.where(causal, s_loc, MASKED)
        s_ctx = None
        if k_ctx is not None:
            s_ctx = jnp.einsum("btkgd,kbsd->bkgts", q_blk, k_ctx, preferred_element_type=jnp.float32)
            s_ctx = jnp.where(ctx_valid[:, None, None, None, :], s_ctx, MASKED)
        out, denom = _softmax_combine(s_loc, s_ctx, v_new[:, :end], v_ctx, weigh, weigh_ctx)
        outs.append(out / jnp.transpose(denom, (0, 3, 1, 2, 4)))  # denom [B, K, G, Tb, 1] -> [B, Tb, K, G, 1]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def paged_attention(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch, scale: float) -> jax.Array:
    """Attention output [B, T, kv_heads, q_per_kv, head_dim] (float32) of the new tokens."""
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    k_ctx = v_ctx = None
    if batch.page_table.shape[1] > 0:
        k_ctx = gather_context(k_pages, batch.page_table)
        v_ctx = gather_context(v_pages, batch.page_table)
    attend = _one_sequence if q.shape[0] == 1 else _batched
    return attend(q, k_new, v_new, k_ctx, v_ctx, batch.ctx_len)
