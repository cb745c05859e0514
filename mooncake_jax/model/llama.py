"""The LLaMA architecture as Flax NNX modules over a paged KV cache.

Every parameter carries its *logical* axis names (``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``,
``vocab``) as sharding metadata; ``mooncake_jax.sharding`` maps them to mesh axes with one rules table, so the model
code never names a mesh axis. Layers are separate modules (not stacked): a pipeline stage or a layer-wise prefill
takes a contiguous range of them without slicing weights, and each layer's KV pages are their own buffers that a
jitted step updates in place.

The forward pass runs over a ``Stage`` (a contiguous layer range, with the embedding if first and the head if last)
so that a single-device engine (one stage of all layers), pipeline stages and layer-wise offload compose the same
pieces.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import PagedBatch, paged_attention, write_pages
from .config import ModelConfig
from .rope import apply_rope, inverse_frequencies

KVPages = tuple[jax.Array, jax.Array]
"""One layer's (K pages, V pages), each head-major [kv_heads, num_pages, block_size, head_dim]."""


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, std: float | None) -> nnx.Param:
    """A parameter with logical axis names; ``std=None`` means ones (norm scales); ``rngs=None`` zeros."""
    if std is None:
        value = jnp.ones(shape, dtype)
    elif rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = _param(None, (dim,), ("embed",), dtype, None)
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` K/V heads in groups."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None):
        d, h, kv, hd, dt = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        std_in, std_out = 1.0 / math.sqrt(d), 1.0 / math.sqrt(h * hd)
        self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), dt, std_in)
        self.wk = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), dt, std_in)
        self.wv = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), dt, std_in)
        self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), dt, std_out)
        self.n_kv_heads, self.q_per_kv, self.head_dim = kv, cfg.q_per_kv, hd
        self.inv_freq = nnx.static(tuple(inverse_frequencies(cfg).tolist()))
        self.impl = cfg.attention

    def __call__(self, x, positions, kv: KVPages, batch: PagedBatch):
        b, t, _ = x.shape
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...])
        k = jnp.einsum("btd,dhk->bthk", x, self.wk[...])
        v = jnp.einsum("btd,dhk->bthk", x, self.wv[...])
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        q = q.reshape(b, t, self.n_kv_heads, self.q_per_kv, self.head_dim)
        # Write first, then read the context from the written pages: reading the old buffer while writing the
        # new one would make XLA copy the whole cache to keep both alive (the writes land outside ctx_len anyway).
        k_pages = write_pages(kv[0], k, batch.write_slots)
        v_pages = write_pages(kv[1], v, batch.write_slots)
        out = paged_attention(q, k, v, k_pages, v_pages, batch, 1.0 / math.sqrt(self.head_dim), impl=self.impl)
        out = out.reshape(b, t, self.n_kv_heads * self.q_per_kv, self.head_dim).astype(x.dtype)
        y = jnp.einsum("bthk,hkd->btd", out, self.wo[...])
        return y, (k_pages, v_pages)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None):
        d, f, dt = cfg.d_model, cfg.ffn_dim, cfg.param_dtype
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), dt, 1.0 / math.sqrt(d))
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), dt, 1.0 / math.sqrt(d))
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), dt, 1.0 / math.sqrt(f))

    def __call__(self, x):
        gate = jnp.einsum("btd,df->btf", x, self.w_gate[...])
        up = jnp.einsum("btd,df->btf", x, self.w_up[...])
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, kv: KVPages, batch: PagedBatch):
        h, kv = self.attn(self.attn_norm(x), positions, kv, batch)
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return x, kv


class Llama(nnx.Module):
    """A LLaMA-architecture decoder. ``rngs=None`` builds zero weights (for loading a checkpoint into)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None):
        d, v, dt = cfg.d_model, cfg.vocab_size, cfg.param_dtype
        self.cfg = nnx.static(cfg)
        self.embedding = _param(rngs, (v, d), ("vocab", "embed"), dt, 1.0)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(d, cfg.norm_eps, dt)
        self.lm_head = None if cfg.tie_embeddings else _param(rngs, (d, v), ("embed", "vocab"), dt,
                                                               1.0 / math.sqrt(d))

    def __call__(self, tokens, positions, kv: list[KVPages], batch: PagedBatch, logits_index=None):
        """Full forward. ``logits_index`` [B] picks one position per sequence (None: logits at every position)."""
        return Stage(self, 0, self.cfg.n_layers)(tokens, positions, kv, batch, logits_index)


class Stage(nnx.Module):
    """Layers ``start .. stop`` of a model, with the embedding if it is the first stage and the head if the last.

    The unit a device (group) holds: a single-device engine runs one stage of all layers; a pipeline runs several,
    passing hidden states between them. It shares the model's parameters (no copies).
    """

    def __init__(self, model: Llama, start: int, stop: int):
        cfg = model.cfg
        if not 0 <= start < stop <= cfg.n_layers:
            raise ValueError(f"bad layer range [{start}, {stop}) for a model of {cfg.n_layers} layers")
        self.cfg = nnx.static(cfg)
        self.start, self.stop = start, stop
        self.is_first, self.is_last = start == 0, stop == cfg.n_layers
        needs_embedding = self.is_first or (self.is_last and cfg.tie_embeddings)
        self.embedding = model.embedding if needs_embedding else None
        self.layers = nnx.List(list(model.layers[start:stop]))
        self.final_norm = model.final_norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def head(self, x):
        """Logits (float32) of hidden states ``x`` [..., d]."""
        x = self.final_norm(x)
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", x, self.embedding[...], preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, self.lm_head[...], preferred_element_type=jnp.float32)

    def __call__(self, inputs, positions, kv: list[KVPages], batch: PagedBatch, logits_index=None):
        """(hidden states, or logits if last stage; this stage's updated KV pages).

        ``inputs`` are token ids [B, T] for the first stage, hidden states [B, T, d] for the others.
        """
        x = jnp.take(self.embedding[...], inputs, axis=0) if self.is_first else inputs
        new_kv = []
        for layer, layer_kv in zip(self.layers, kv):
            x, layer_kv = layer(x, positions, layer_kv, batch)
            new_kv.append(layer_kv)
        if not self.is_last:
            return x, new_kv
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        return self.head(x), new_kv


def init_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    """The model with deterministic dummy weights drawn from ``seed`` (initialised in one compiled call)."""
    graphdef, _ = nnx.split(abstract_model(cfg))
    state = jax.jit(lambda: nnx.state(Llama(cfg, nnx.Rngs(params=seed))))()
    return nnx.merge(graphdef, state)


def abstract_model(cfg: ModelConfig) -> Llama:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and bytes of a 70B model without allocating."""
    return nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(params=0)))


def param_bytes(model: Llama) -> int:
    state = nnx.state(model, nnx.Param)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
