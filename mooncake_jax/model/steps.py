"""Pure, jitted step functions over pytrees: the engine's whole device-side contract.

``forward_step(graphdef, params, kv, inputs, positions, batch, logits_index, sampling, mode)`` runs T new tokens of
B sequences through one stage of the model (its layers under one ``lax.scan``) over its stacked paged KV cache and
returns (next tokens, logits or hidden states, updated KV). Prefill is a call with one sequence and T = chunk
length; decode is a call with B sequences and T = 1. The KV arrays are donated, so XLA updates them in place. A
JAX user can embed these functions directly: their inputs are the stage's parameter state (``nnx.split``), the
stage's (K, V) arrays [kv_heads, n_layers * num_pages, block_size, head_dim] (in ``kv_scatter.storage_dtype``: on
CPU a 16-bit float cache as 16-bit integers; ``read_blocks`` / ``read_layer`` return the float values, the writes
take them), int32 arrays and a few statics.

Layer by layer (when layer hooks run between layers): ``embed_step``, then ``layer_step`` (scanned stage: the layer
index is a traced argument that slices the stacked parameters) or ``layer_apply_step`` (unrolled stage: the layer's
own parameters) once per layer, one program for every layer of a stage either way, then ``head_step``;
``read_layer`` / ``write_layer`` move one layer's blocks out of and into the stacked cache.

``graphdef`` is an NNX ``GraphDef`` or a ``HashedGraph`` holding one: jax.jit hashes its static arguments on every
call, and a ``GraphDef`` hashes its whole node tree each time, so the engine passes its graphs hashed once.

Shapes are bucketed by the caller (powers of two for T and B; the context table one width per attention
implementation, ``Engine.context_width``) so a serving loop compiles a handful of variants, not one per request.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import PagedBatch
from .kv_scatter import as_logical, set_at
from .llama import layer_apply
from .packed_inputs import Packing, unpack
from .sampling import GREEDY, SamplingInputs, sample_out


class HashedGraph:
    """An NNX ``GraphDef`` as a jit static argument, its hash computed once.

    jax.jit hashes static arguments on every call; a ``GraphDef`` walks and sorts its node tree to hash (measured
    0.24 ms for the ``tiny`` preset, 0.63 ms for ``small``, under load, with the interpreter lock held), which on the
    decode path was paid every step. Equal graphs stay equal (so engines of one model share compiled programs)."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, HashedGraph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)


def graph_of(graphdef) -> nnx.GraphDef:
    """The ``GraphDef`` itself, of a ``GraphDef`` or a ``HashedGraph``."""
    return graphdef.graphdef if isinstance(graphdef, HashedGraph) else graphdef


def merge(graphdef, params):
    """``nnx.merge`` of a ``GraphDef`` or a ``HashedGraph``."""
    return nnx.merge(graph_of(graphdef), params)


def plain_arrays(state: nnx.State) -> nnx.State:
    """``state`` with each ``nnx.Variable`` replaced by its array: the same tree to ``nnx.merge``, and flattened by
    jax.jit on every call in a fifth of the time (a Variable is a pytree node of its own, flattened in Python)."""
    return jax.tree.map(lambda v: v.get_value(), state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@partial(jax.jit, static_argnames=("graphdef", "mode"), donate_argnames=("kv",))
def forward_step(graphdef, params, kv, inputs, positions, batch: PagedBatch, logits_index, sampling: SamplingInputs,
                 mode: str = GREEDY):
    """Run one stage (``graphdef``/``params`` of a ``llama.Stage``; all layers for a single-device engine).

    Returns (next_tokens or None, output, kv): for the last stage the output is the logits ([B, V], or
    [B, T, V] with ``logits_index=None``) and next_tokens (a ``sampling.SampleOut``: tokens [B] and their
    logprobs) are sampled from them; for the other stages the output is the hidden states [B, T, d] for the next
    stage and next_tokens is None.
    """
    return _forward(graphdef, params, kv, inputs, positions, batch, logits_index, sampling, mode)


@partial(jax.jit, static_argnames=("graphdef", "packing", "mode"), donate_argnames=("kv",))
def forward_step_packed(graphdef, params, kv, buffer, passed, packing: Packing, mode: str = GREEDY):
    """``forward_step`` of (inputs, positions, batch, logits_index, sampling) packed by ``packed_inputs.pack``: the
    host arrays of a step in one host-to-device copy."""
    return _forward(graphdef, params, kv, *unpack(buffer, passed, packing), mode)


def _forward(graphdef, params, kv, inputs, positions, batch, logits_index, sampling, mode):
    stage = merge(graphdef, params)
    out, kv = stage(inputs, positions, kv, batch, logits_index)
    next_tokens = sample_out(out, sampling, mode) if stage.is_last and logits_index is not None else None
    return next_tokens, out, kv


@partial(jax.jit, static_argnames=("graphdef",))
def embed_step(graphdef, params, inputs):
    """The stage's input hidden states (token embeddings on the first stage, ``inputs`` unchanged elsewhere)."""
    return merge(graphdef, params).embed(inputs)


@partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("kv",))
def layer_step(graphdef, params, kv, layer, x, positions, batch: PagedBatch):
    """Stage-local layer ``layer`` (an int32 scalar, traced: one program for every layer) over hidden states ``x``.
    Returns (x, kv)."""
    return merge(graphdef, params).layer(layer, x, positions, kv, batch)


@partial(jax.jit, static_argnames=("graphdef", "n_layers"), donate_argnames=("kv",))
def layer_apply_step(graphdef, layer_params, kv, layer, x, positions, batch: PagedBatch, n_layers: int):
    """An unrolled stage's layer: ``graphdef``/``layer_params`` of one unstacked ``DecoderLayer`` as stage-local
    layer ``layer`` (traced: every layer has the same shapes, so one program serves them all). Returns (x, kv)."""
    return layer_apply(graph_of(graphdef), layer_params, layer, x, positions, kv, batch, n_layers)


@partial(jax.jit, static_argnames=("graphdef", "mode"))
def head_step(graphdef, params, x, logits_index, sampling: SamplingInputs, mode: str = GREEDY):
    """(next_tokens or None, output) of the stage's last layer's hidden states, as ``forward_step`` returns them."""
    stage = merge(graphdef, params)
    out = stage.output(x, logits_index)
    next_tokens = sample_out(out, sampling, mode) if stage.is_last and logits_index is not None else None
    return next_tokens, out


def _rows(kv, pages, n_layers: int):
    """Rows [n_layers, n] of ``pages`` in every layer of a stacked cache."""
    num_pages = kv[0].shape[1] // n_layers
    return jnp.arange(n_layers, dtype=jnp.int32)[:, None] * num_pages + pages[None, :]


@partial(jax.jit, static_argnames=("n_layers",), donate_argnames=("kv",))
def write_blocks(kv, pages, blocks, n_layers: int):
    """Write whole blocks [n, layers, 2, block_size, kv_heads, head_dim] into ``pages`` [n] of every layer of the
    stacked cache ``kv`` of ``n_layers`` layers (KV arriving from the pool or another instance)."""
    rows = _rows(kv, pages, n_layers)
    k, v = kv
    # [n, L, bs, H, D] -> [H, L, n, bs, D], the layout of k[:, rows]
    k = set_at(k, (slice(None), rows), jnp.transpose(blocks[:, :, 0], (3, 1, 0, 2, 4)))
    v = set_at(v, (slice(None), rows), jnp.transpose(blocks[:, :, 1], (3, 1, 0, 2, 4)))
    return k, v


@partial(jax.jit, static_argnames=("n_layers",))
def read_blocks(kv, pages, n_layers: int):
    """Whole blocks [n, layers, 2, block_size, kv_heads, head_dim] of ``pages`` [n] (KV leaving for the pool)."""
    rows = _rows(kv, pages, n_layers)
    both = as_logical(jnp.stack([kv[0][:, rows], kv[1][:, rows]]))  # [2, H, L, n, bs, D]
    return jnp.transpose(both, (3, 2, 0, 4, 1, 5))


@partial(jax.jit, static_argnames=("n_layers",), donate_argnames=("kv",))
def write_layer(kv, layer, pages, blocks, n_layers: int):
    """Write one layer's blocks [n, 2, block_size, kv_heads, head_dim] into ``pages`` [n] of stage-local
    ``layer`` (traced)."""
    rows = layer * (kv[0].shape[1] // n_layers) + pages
    k, v = kv
    k = set_at(k, (slice(None), rows), jnp.transpose(blocks[:, 0], (2, 0, 1, 3)))
    v = set_at(v, (slice(None), rows), jnp.transpose(blocks[:, 1], (2, 0, 1, 3)))
    return k, v


@partial(jax.jit, static_argnames=("n_layers",))
def read_layer(kv, layer, pages, n_layers: int):
    """One layer's blocks [n, 2, block_size, kv_heads, head_dim] of ``pages`` [n] (stage-local ``layer``, traced)."""
    rows = layer * (kv[0].shape[1] // n_layers) + pages
    both = as_logical(jnp.stack([kv[0][:, rows], kv[1][:, rows]]))  # [2, H, n, bs, D]
    return jnp.transpose(both, (2, 0, 3, 1, 4))
