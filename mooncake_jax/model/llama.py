"""The LLaMA architecture as Flax NNX modules over a paged KV cache.

Every parameter carries its *logical* axis names (``layers``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``vocab``) as sharding metadata; ``mooncake_jax.sharding`` maps them to mesh axes with one rules table, so
the model code never names a mesh axis.

The decoder layers are one stacked module: every layer parameter has a leading ``layers`` axis, and a forward pass
runs them under ``jax.lax.scan``, so the compiled program holds one layer body whatever the depth (an 80-layer
model compiles about as fast as an 8-layer one). A pipeline stage takes a contiguous slice of the stack. The KV
cache of a stage is stacked the same way: one K and one V array [kv_heads, n_layers * num_pages, block_size,
head_dim], layer l's page p at row l * num_pages + p; the scan carries both arrays and each layer offsets the page
table and write slots by l * num_pages, so a layer reads only its own context rows.

The forward pass runs over a ``Stage`` (a contiguous layer range, with the embedding if first and the head if last)
so that a single-device engine (one stage of all layers), pipeline stages and layer-by-layer execution (layer hooks,
``Stage.layer``: one compiled program whose layer index is a traced argument) compose the same pieces.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import PagedBatch, paged_attention, write_pages
from .config import ModelConfig
from .rope import apply_rope, inverse_frequencies

OUTPUT_MAJOR = {
    "wq": (1, 2, 0), "wk": (1, 2, 0), "wv": (1, 2, 0), "wo": (2, 0, 1),  # [h, hd, d] and [d, h, hd]
    "w_gate": (1, 0), "w_up": (1, 0), "w_down": (1, 0), "lm_head": (1, 0),
}
"""How an unrolled (CPU) stage's decode copy holds each weight matrix: its canonical axes permuted so that the
contracted axes (the input features) come last, i.e. each output feature's weights are contiguous. XLA:CPU's
small-batch matmuls (YNNPACK) stream a [out, in] weight faster than the canonical [in, out] (48 chained
768 x 2048 products on a 2-core Xeon (207), CPU time: 102 against 165 ms at M = 32, 57 against 79 at M = 8), but
the 2048-token prefill of a stage holding only [out, in] copies ran 17-20% slower (tenth pass), so the stage keeps
both: canonical for prefill, this for decode (``ModelConfig.decode_weights``; docs/benchmarks/engine.md, eleventh
pass). The model, its checkpoints, HF import and scanned stages keep the canonical layout only."""


STREAMED_ROWS_MAX = 32
"""Most rows (tokens of a decode step) for which ``decode_product`` streams the weight as the left-hand operand:
whole decode steps on the EPYC took 0.66x the CPU time at batch 8 and 0.82-0.86x at 32, but 1.02x at 64 (dense
products alone: 0.75x at 32 rows, 0.96-0.98x at 48-64), where the plain form's packing is amortised."""


def decode_product(x, w, out_dtype=None):
    """``x`` [..., K] times an output-major weight ``w`` [N, K] (the decode copy): [..., N], computed as
    ``w @ x.T`` then transposed back.

    XLA:CPU hands a dot to YNNPACK as it is written, and YNNPACK packs the right-hand operand into its kernel's
    tiles on every call: written ``x @ w.T`` (the plain form) that operand is the whole weight, transposed into
    tiles at each step, a read and write of every weight that a decode batch of 32 rows cannot amortise (a third
    of the LM head's time in ``ynn::transpose_x32_avx2``). Written ``w @ x.T`` the weight is the left-hand operand,
    which the kernel streams in place, and only the few activation rows are packed: 0.70-0.90x the CPU time of the
    plain form for the decode shapes of ``small`` at M = 32 (docs/benchmarks/engine.md, twentieth pass). The
    ``optimization_barrier`` keeps XLA's algebraic simplifier from folding the transpose back into the dot (which
    would restore the plain form); the transpose back is a copy of the [N, M] result only. More than
    ``STREAMED_ROWS_MAX`` rows, and backends other than XLA:CPU (whose matmul libraries were not measured so),
    take the plain form. ``out_dtype``: the product's result type (default ``x``'s)."""
    lead, dtype = x.shape[:-1], out_dtype or x.dtype
    if math.prod(lead) > STREAMED_ROWS_MAX or jax.default_backend() != "cpu":
        return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=dtype)
    y = jnp.einsum("nk,mk->nm", w, x.reshape(-1, x.shape[-1]), preferred_element_type=dtype)
    return jax.lax.optimization_barrier(y).T.reshape(lead + (w.shape[0],))


KVPages = tuple[jax.Array, jax.Array]
"""A stage's (K pages, V pages), each [kv_heads, n_layers * num_pages, block_size, head_dim] (a single layer's
view inside the scan is the same arrays with the page table offset to its rows)."""


def _orders(output_major: bool):
    """``name -> axis order`` of a module's weights: ``OUTPUT_MAJOR``'s when held output-major, else None (canonical)."""
    return (lambda name: OUTPUT_MAJOR[name]) if output_major else (lambda name: None)


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, std: float | None, stack: int | None = None,
           order: tuple[int, ...] | None = None) -> nnx.Param:
    """A parameter with logical axis names; ``std=None`` means ones (norm scales); ``rngs=None`` zeros.

    ``stack``: a leading ``layers`` axis of that size (the parameter of every layer of a stacked layer module).
    ``order``: the canonical shape and axes permuted (``OUTPUT_MAJOR``): the same weight held transposed.
    """
    if order is not None:
        shape, axes = tuple(shape[i] for i in order), tuple(axes[i] for i in order)
    if stack is not None:
        shape, axes = (stack,) + tuple(shape), ("layers",) + tuple(axes)
    if std is None:
        value = jnp.ones(shape, dtype)
    elif rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, stack: int | None = None):
        self.scale = _param(None, (dim,), ("embed",), dtype, None, stack)
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` K/V heads in groups."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None, stack: int | None = None,
                 output_major: bool = False):
        d, h, kv, hd, dt = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        std_in, std_out = 1.0 / math.sqrt(d), 1.0 / math.sqrt(h * hd)
        order = _orders(output_major)
        self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), dt, std_in, stack, order("wq"))
        self.wk = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), dt, std_in, stack, order("wk"))
        self.wv = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), dt, std_in, stack, order("wv"))
        self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), dt, std_out, stack, order("wo"))
        self.output_major = output_major
        self.n_kv_heads, self.q_per_kv, self.head_dim = kv, cfg.q_per_kv, hd
        self.inv_freq = nnx.static(tuple(inverse_frequencies(cfg).tolist()))
        self.impl = cfg.attention

    def __call__(self, x, positions, kv: KVPages, batch: PagedBatch):
        b, t, _ = x.shape
        q, k, v = (self._project(x, w[...]) for w in (self.wq, self.wk, self.wv))
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        q = q.reshape(b, t, self.n_kv_heads, self.q_per_kv, self.head_dim)
        # Write first, then read the context from the written pages: reading the old buffer while writing the
        # new one would make XLA copy the whole cache to keep both alive (the writes land outside ctx_len anyway).
        k_pages = write_pages(kv[0], k, batch.write_slots)
        v_pages = write_pages(kv[1], v, batch.write_slots)
        out = paged_attention(q, k, v, k_pages, v_pages, batch, 1.0 / math.sqrt(self.head_dim), impl=self.impl)
        out = out.reshape(b, t, self.n_kv_heads * self.q_per_kv, self.head_dim).astype(x.dtype)
        if self.output_major:  # one [d, h * hd] matrix (a free reshape), so XLA sees a plain 2-D product
            wo = self.wo[...]
            y = decode_product(out.reshape(b, t, -1), wo.reshape(wo.shape[0], -1))
        else:
            y = jnp.einsum("bthk,hkd->btd", out, self.wo[...])
        return y, (k_pages, v_pages)

    def _project(self, x, w):
        """x [B, T, d] times a q/k/v weight: [d, h, hd], or [h, hd, d] output-major, seen as one [h * hd, d]
        matrix: with the two output axes kept apart, XLA:CPU transposed the whole weight back every step."""
        if not self.output_major:
            return jnp.einsum("btd,dhk->bthk", x, w)
        h, hd, d = w.shape
        return decode_product(x, w.reshape(h * hd, d)).reshape(x.shape[:2] + (h, hd))


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None, stack: int | None = None,
                 output_major: bool = False):
        d, f, dt = cfg.d_model, cfg.ffn_dim, cfg.param_dtype
        order = _orders(output_major)
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), dt, 1.0 / math.sqrt(d), stack, order("w_gate"))
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), dt, 1.0 / math.sqrt(d), stack, order("w_up"))
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), dt, 1.0 / math.sqrt(f), stack, order("w_down"))
        self.output_major = output_major

    def __call__(self, x):
        if self.output_major:
            gate, up = decode_product(x, self.w_gate[...]), decode_product(x, self.w_up[...])
            return decode_product(jax.nn.silu(gate) * up, self.w_down[...])
        gate = jnp.einsum("btd,df->btf", x, self.w_gate[...])
        up = jnp.einsum("btd,df->btf", x, self.w_up[...])
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down[...])


class DecoderLayer(nnx.Module):
    """One decoder layer; built with ``stack=n`` it holds the parameters of ``n`` layers (leading ``layers`` axis),
    and ``stacked_layers`` runs them under a scan (the body sees one layer's slice)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None, stack: int | None = None,
                 output_major: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, stack)
        self.attn = Attention(cfg, rngs, stack, output_major)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype, stack)
        self.mlp = MLP(cfg, rngs, stack, output_major)

    def __call__(self, x, positions, kv: KVPages, batch: PagedBatch):
        h, kv = self.attn(self.attn_norm(x), positions, kv, batch)
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return x, kv


def layer_batch(batch: PagedBatch, layer, num_pages: int, block_size: int) -> PagedBatch:
    """``batch`` moved to the rows of (stage-local) ``layer`` in a stacked cache of ``num_pages`` pages per layer.

    Padding entries (scratch page 0) land on the layer's own scratch row, which no sequence reads either.
    """
    offset = layer * num_pages
    return PagedBatch(batch.page_table + offset, batch.ctx_len, batch.write_slots + offset * block_size)


def _apply_layer(graphdef, layer_params, layer, x, positions, kv: KVPages, batch: PagedBatch, n_layers: int):
    """Layer ``layer`` (its parameter slice ``layer_params``) over the stacked cache ``kv`` of ``n_layers``."""
    num_pages, block_size = kv[0].shape[1] // n_layers, kv[0].shape[2]
    return nnx.merge(graphdef, layer_params)(x, positions, kv, layer_batch(batch, layer, num_pages, block_size))


def stacked_layers(layers: DecoderLayer, n_layers: int, x, positions, kv: KVPages, batch: PagedBatch):
    """Run the ``n_layers`` stacked ``layers`` over ``x`` under ``lax.scan``; returns (x, updated stacked KV)."""
    graphdef, params = nnx.split(layers)

    def body(carry, layer_params):
        x, k, v, layer = carry
        x, (k, v) = _apply_layer(graphdef, layer_params, layer, x, positions, (k, v), batch, n_layers)
        return (x, k, v, layer + 1), None

    (x, k, v, _), _ = jax.lax.scan(body, (x, kv[0], kv[1], jnp.int32(0)), params)
    return x, (k, v)


def _slice_layers(layers: DecoderLayer, start: int, stop: int) -> DecoderLayer:
    """Layers ``start .. stop`` of a stacked module, as a module of their own (abstract leaves stay abstract)."""
    def take(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((stop - start,) + x.shape[1:], x.dtype)
        return x[start:stop]

    graphdef, state = nnx.split(layers)
    return nnx.merge(graphdef, jax.tree.map(take, state))


def _transposed(x, order: tuple[int, ...] | None):
    """``x`` (an array or a ``jax.ShapeDtypeStruct``) with its axes permuted by ``order`` (None: as it is)."""
    if order is None:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(x.shape[i] for i in order), x.dtype)
    return jnp.transpose(x, order)


def _unstack_layers(layers: DecoderLayer, cfg: ModelConfig, start: int, stop: int,
                    output_major: bool = False) -> list[DecoderLayer]:
    """Layers ``start .. stop`` of a stacked module as plain layers, each with buffers of its own (copies) and the
    logical axes of an unstacked layer (no ``layers`` axis); with ``output_major`` each weight matrix transposed as
    ``OUTPUT_MAJOR`` says."""
    graphdef, template = nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, None, output_major=output_major)))
    stacked = nnx.to_pure_dict(nnx.state(layers))
    out = []
    for i in range(start, stop):
        def take(path, x, i=i):
            name = path[-1].key
            one = jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x[i]
            return _transposed(one, OUTPUT_MAJOR.get(name) if output_major else None)

        state = jax.tree.map(lambda v: v, template)  # a fresh state to fill
        nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(take, stacked))
        out.append(nnx.merge(graphdef, state))
    return out


class Llama(nnx.Module):
    """A LLaMA-architecture decoder. ``rngs=None`` builds zero weights (for loading a checkpoint into)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None):
        d, v, dt = cfg.d_model, cfg.vocab_size, cfg.param_dtype
        self.cfg = nnx.static(cfg)
        self.embedding = _param(rngs, (v, d), ("vocab", "embed"), dt, 1.0)
        self.layers = DecoderLayer(cfg, rngs, stack=cfg.n_layers)
        self.final_norm = RMSNorm(d, cfg.norm_eps, dt)
        self.lm_head = None if cfg.tie_embeddings else _param(rngs, (d, v), ("embed", "vocab"), dt,
                                                               1.0 / math.sqrt(d))

    def __call__(self, tokens, positions, kv: KVPages, batch: PagedBatch, logits_index=None):
        """Full forward. ``logits_index`` [B] picks one position per sequence (None: logits at every position)."""
        return Stage(self, 0, self.cfg.n_layers)(tokens, positions, kv, batch, logits_index)


class Stage(nnx.Module):
    """Layers ``start .. stop`` of a model, with the embedding if it is the first stage and the head if the last.

    The unit a device (group) holds: a single-device engine runs one stage of all layers (sharing the model's
    parameters); a pipeline runs several, passing hidden states between them (each holds its slice of the stack).

    ``scan=True`` keeps the layers stacked and runs them under ``lax.scan`` (compile time flat in depth; the form
    for GPU/TPU, where a dynamic slice of the stacked weights feeds the matmul directly). ``scan=False`` holds every
    layer's parameters as buffers of their own (copied out of the stack once) and unrolls the layers: XLA:CPU
    materialises a dynamic slice of each weight before its matmul, which made a memory-bound decode step of the
    ``small`` preset about 3x slower scanned than unrolled.

    Decode copy (``ModelConfig.keeps_decode_copy()``, unrolled stages only): the stage also holds its
    layers' weight matrices and LM head transposed (``OUTPUT_MAJOR``), and a step of one token per sequence (decode,
    T = 1) runs on them; longer steps (prefill) keep the canonical copies. Scanned stages (GPU/TPU) hold one copy.
    """

    def __init__(self, model: Llama, start: int, stop: int, scan: bool = True):
        cfg = model.cfg
        if not 0 <= start < stop <= cfg.n_layers:
            raise ValueError(f"bad layer range [{start}, {stop}) for a model of {cfg.n_layers} layers")
        self.cfg = nnx.static(cfg)
        self.start, self.stop = start, stop
        self.n_layers = stop - start
        self.scan = scan
        self.is_first, self.is_last = start == 0, stop == cfg.n_layers
        needs_embedding = self.is_first or (self.is_last and cfg.tie_embeddings)
        self.embedding = model.embedding if needs_embedding else None
        if not scan:
            self.layers = nnx.List(_unstack_layers(model.layers, cfg, start, stop))
        elif start == 0 and stop == cfg.n_layers:
            self.layers = model.layers
        else:
            self.layers = _slice_layers(model.layers, start, stop)
        self.final_norm = model.final_norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        copy = not scan and cfg.keeps_decode_copy()
        self.decode_layers = (nnx.List(_unstack_layers(model.layers, cfg, start, stop, output_major=True))
                              if copy else None)
        head = None
        if copy and self.lm_head is not None:
            order, axes = OUTPUT_MAJOR["lm_head"], model.lm_head.get_metadata()["out_sharding"]
            head = nnx.Param(_transposed(model.lm_head.get_value(), order), eager_sharding=False,
                             out_sharding=tuple(axes[i] for i in order))
        self.decode_lm_head = head

    def embed(self, inputs):
        """The first stage's hidden states of token ids [B, T]; other stages' inputs are hidden states already."""
        return jnp.take(self.embedding[...], inputs, axis=0) if self.is_first else inputs

    def head(self, x, decode: bool = False):
        """Logits (float32) of hidden states ``x`` [..., d] (``decode``: through the decode copy, if any)."""
        x = self.final_norm(x)
        if decode and self.decode_lm_head is not None:
            return decode_product(x, self.decode_lm_head[...], jnp.float32)
        if self.lm_head is None:  # tied: the embedding [V, d] is output-major already
            if decode:
                return decode_product(x, self.embedding[...], jnp.float32)
            return jnp.einsum("...d,vd->...v", x, self.embedding[...], preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, self.lm_head[...], preferred_element_type=jnp.float32)

    def output(self, x, logits_index=None, decode: bool = False):
        """What the stage hands on: hidden states, or (last stage) logits at ``logits_index`` [B] (None: all)."""
        if not self.is_last:
            return x
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]
        return self.head(x, decode)

    def layer(self, layer, x, positions, kv: KVPages, batch: PagedBatch):
        """Only (stage-local) layer ``layer`` of a scanned stage, which may be traced: one program serves every
        layer of the stage. (An unrolled stage's runner calls ``layer_apply`` with the layer's own parameters.)"""
        if not self.scan:
            raise ValueError("Stage.layer needs the stacked layers of a scanned stage (scan=True)")
        graphdef, params = nnx.split(self.layers)
        params = jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, layer, keepdims=False), params)
        return _apply_layer(graphdef, params, layer, x, positions, kv, batch, self.n_layers)

    def __call__(self, inputs, positions, kv: KVPages, batch: PagedBatch, logits_index=None):
        """(hidden states, or logits if last stage; this stage's updated stacked KV).

        ``inputs`` are token ids [B, T] for the first stage, hidden states [B, T, d] for the others.
        """
        x = self.embed(inputs)
        decode = positions.shape[1] == 1 and self.decode_layers is not None
        if self.scan:
            x, kv = stacked_layers(self.layers, self.n_layers, x, positions, kv, batch)
        else:
            num_pages, block_size = kv[0].shape[1] // self.n_layers, kv[0].shape[2]
            for i, layer in enumerate(self.decode_layers if decode else self.layers):
                x, kv = layer(x, positions, kv, layer_batch(batch, i, num_pages, block_size))
        return self.output(x, logits_index, decode), kv


def layer_apply(graphdef, layer_params, layer, x, positions, kv: KVPages, batch: PagedBatch, n_layers: int):
    """One unstacked layer (``graphdef``/``layer_params`` of a ``DecoderLayer`` without the ``layers`` axis) as
    stage-local layer ``layer`` (may be traced) of a stacked cache of ``n_layers`` layers. Returns (x, kv)."""
    return _apply_layer(graphdef, layer_params, layer, x, positions, kv, batch, n_layers)


def init_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    """The model with deterministic dummy weights drawn from ``seed`` (initialised in one compiled call, which a
    process compiles once per configuration and seed: every later model of the same shape reuses it)."""
    graphdef, _ = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, _initial_state(cfg, seed))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _initial_state(cfg: ModelConfig, seed: int):
    """(A function of its own, not a lambda made per call: jit's cache is keyed by the function, so a fresh lambda
    traced and compiled the whole initialisation again for every model, 3-4 s on 2 cores for ``tiny``.)"""
    return nnx.state(Llama(cfg, nnx.Rngs(params=seed)))


def abstract_model(cfg: ModelConfig) -> Llama:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and bytes of a 70B model without allocating."""
    return nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(params=0)))


def param_bytes(model: Llama) -> int:
    state = nnx.state(model, nnx.Param)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
