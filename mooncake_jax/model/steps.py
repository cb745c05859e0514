"""Pure, jitted step functions over pytrees: the engine's whole device-side contract.

``forward_step(graphdef, params, kv, inputs, positions, batch, logits_index, sampling, mode)`` runs T new tokens of
B sequences through one stage of the model over its paged KV cache and returns (next tokens, logits or hidden
states, updated KV). Prefill is a call with one sequence and T = chunk length; decode is a call with B sequences
and T = 1. The KV pages are donated, so XLA updates them in place. A JAX user can embed these functions
directly: their inputs are the stage's parameter state (``nnx.split``), a list of per-layer (K, V) page arrays,
int32 arrays and a few statics.

Shapes are bucketed by the caller (powers of two for T, B and the number of context pages) so a serving loop
compiles a handful of variants, not one per request.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import PagedBatch
from .sampling import GREEDY, SamplingInputs, sample


@partial(jax.jit, static_argnames=("graphdef", "mode"), donate_argnames=("kv",))
def forward_step(graphdef, params, kv, inputs, positions, batch: PagedBatch, logits_index, sampling: SamplingInputs,
                 mode: str = GREEDY):
    """Run one stage (``graphdef``/``params`` of a ``llama.Stage``; all layers for a single-device engine).

    Returns (next_tokens [B] or None, output, kv): for the last stage the output is the logits ([B, V], or
    [B, T, V] with ``logits_index=None``) and next_tokens are sampled from them; for the other stages the output is
    the hidden states [B, T, d] for the next stage and next_tokens is None.
    """
    stage = nnx.merge(graphdef, params)
    out, kv = stage(inputs, positions, kv, batch, logits_index)
    next_tokens = sample(out, sampling, mode) if stage.is_last and logits_index is not None else None
    return next_tokens, out, kv


@partial(jax.jit, donate_argnames=("kv",))
def write_blocks(kv, pages, blocks):
    """Write whole blocks [n, layers, 2, block_size, kv_heads, head_dim] into ``pages`` [n] of the layers
    in ``kv`` (KV arriving from the pool or another instance)."""
    out = []
    for layer, (k, v) in enumerate(kv):  # wire [n, bs, H, D] -> cache [H, n, bs, D]
        out.append((k.at[:, pages].set(jnp.transpose(blocks[:, layer, 0], (2, 0, 1, 3)).astype(k.dtype)),
                    v.at[:, pages].set(jnp.transpose(blocks[:, layer, 1], (2, 0, 1, 3)).astype(v.dtype))))
    return out


@jax.jit
def read_blocks(kv, pages):
    """Whole blocks [n, layers, 2, block_size, kv_heads, head_dim] of ``pages`` [n] (KV leaving for the pool)."""
    # cache [H, n, bs, D] -> wire [n, bs, H, D]
    return jnp.stack([jnp.stack([jnp.transpose(k[:, pages], (1, 2, 0, 3)), jnp.transpose(v[:, pages], (1, 2, 0, 3))],
                                axis=1) for k, v in kv], axis=1)
