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
k_pages, v_pages [num_pages, block_size, kv_heads, head_dim]; page_table [B, P] int32; ctx_len [B] int32.
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

    page_table: jax.Array  # [B, P] pages holding each sequence's cached context, in order
    ctx_len: jax.Array  # [B] cached tokens before the first new token
    write_slots: jax.Array  # [B, T] flat slot (page * block_size + offset) for each new token's K/V


def query_block_size(t: int) -> int:
    """Static query block of the local causal part.

    Small blocks skip more of the masked upper triangle and keep each block's scores in cache (on a 2-core CPU,
    128-token blocks prefill 2048 tokens 25% faster than 512-token ones), but every block is unrolled into the
    program, so long chunks use at most 16 blocks.
    """
    return t if t <= 128 else max(128, -(-t // 16))


def write_pages(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter ``new`` [B, T, H, D] into ``pages`` [P, bs, H, D] at flat ``slots`` [B, T] (always in bounds:
    padded tokens point into the scratch page).

    Indexed as (page, offset) rather than through a flattened view: XLA turns a one-row scatter into a
    flattened view into a dynamic-update-slice that copies the whole cache on CPU.
    """
    bs = pages.shape[1]
    flat_slots = slots.reshape(-1)
    rows = new.reshape((-1,) + new.shape[2:]).astype(pages.dtype)
    return pages.at[flat_slots // bs, flat_slots % bs].set(rows, mode="promise_in_bounds")


def gather_context(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """The context keys (or values) of each sequence: [B, P * block_size, H, D].

    Gathers whole pages as rows of a 2-D view: XLA:CPU copies contiguous rows about 4x faster than it gathers
    the same bytes from the 4-D array.
    """
    b, p = page_table.shape
    n_pages, bs, h, d = pages.shape
    return pages.reshape(n_pages, bs * h * d)[page_table].reshape(b, p * bs, h, d)


def paged_attention(q, k_new, v_new, k_pages, v_pages, batch: PagedBatch, scale: float) -> jax.Array:
    """Attention output [B, T, kv_heads, q_per_kv, head_dim] (float32) of the new tokens."""
    b, t, hk, g, d = q.shape
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    has_ctx = batch.page_table.shape[1] > 0
    if has_ctx:
        k_ctx = gather_context(k_pages, batch.page_table)
        v_ctx = gather_context(v_pages, batch.page_table)
        ctx_valid = jnp.arange(k_ctx.shape[1])[None, :] < batch.ctx_len[:, None]  # [B, S]
    qb = query_block_size(t)
    outs = []
    for start in range(0, t, qb):
        end = min(start + qb, t)
        q_blk = q[:, start:end]
        # Local causal part: keys [0, end) of the new tokens.
        s_loc = jnp.einsum("btkgd,bskd->bkgts", q_blk, k_new[:, :end], preferred_element_type=jnp.float32)
        causal = jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :]
        s_loc = jnp.where(causal, s_loc, MASKED)
        m = s_loc.max(axis=-1, keepdims=True)
        if has_ctx:
            s_ctx = jnp.einsum("btkgd,bskd->bkgts", q_blk, k_ctx, preferred_element_type=jnp.float32)
            s_ctx = jnp.where(ctx_valid[:, None, None, None, :], s_ctx, MASKED)
            m = jnp.maximum(m, s_ctx.max(axis=-1, keepdims=True))
        e_loc = jnp.exp(s_loc - m)
        denom = e_loc.sum(axis=-1, keepdims=True)
        out = jnp.einsum("bkgts,bskd->btkgd", e_loc.astype(v_new.dtype), v_new[:, :end],
                         preferred_element_type=jnp.float32)
        if has_ctx:
            e_ctx = jnp.exp(s_ctx - m)
            denom = denom + e_ctx.sum(axis=-1, keepdims=True)
            out = out + jnp.einsum("bkgts,bskd->btkgd", e_ctx.astype(v_ctx.dtype), v_ctx,
                                   preferred_element_type=jnp.float32)
        # denom [B, K, G, Tb, 1] -> [B, Tb, K, G, 1]
        outs.append(out / jnp.transpose(denom, (0, 3, 1, 2, 4)))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
