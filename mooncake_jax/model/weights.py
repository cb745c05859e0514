"""Weights: import a local Hugging Face ``LlamaForCausalLM`` folder; save and restore with orbax-checkpoint.

HF stores projections as ``[out_features, in_features]``; the model keeps einsum-friendly layouts with explicit
head axes (``wq [embed, heads, head_dim]``, ``wo [heads, head_dim, embed]``, ...), and stacks the decoder layers
(``layers.attn.wq [n_layers, embed, heads, head_dim]``: HF's ``model.layers.{i}.*`` is row i). ``LAYER_LAYOUT`` and
``TOP_LAYOUT`` are the one table of name and layout correspondences; loading reads each tensor once, checks its
shape, writes it into its row of the stacked parameter in place, and builds the model state without first
materialising dummy weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from .config import ModelConfig, from_hf_config
from .llama import Llama, abstract_model

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _t(x, cfg):
    return x.T


def _heads_in(n_heads_attr: str) -> Transform:
    """[heads * head_dim, d] -> [d, heads, head_dim]"""
    def f(x, cfg):
        return x.T.reshape(cfg.d_model, getattr(cfg, n_heads_attr), cfg.head_dim)
    return f


def _heads_out(x, cfg):
    """[d, heads * head_dim] -> [heads, head_dim, d]"""
    return x.T.reshape(cfg.n_heads, cfg.head_dim, cfg.d_model)


def _same(x, cfg):
    return x


LAYER_LAYOUT: dict[str, tuple[tuple[str, ...], Transform]] = {
    "self_attn.q_proj.weight": (("attn", "wq"), _heads_in("n_heads")),
    "self_attn.k_proj.weight": (("attn", "wk"), _heads_in("n_kv_heads")),
    "self_attn.v_proj.weight": (("attn", "wv"), _heads_in("n_kv_heads")),
    "self_attn.o_proj.weight": (("attn", "wo"), _heads_out),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), _t),
    "mlp.up_proj.weight": (("mlp", "w_up"), _t),
    "mlp.down_proj.weight": (("mlp", "w_down"), _t),
    "input_layernorm.weight": (("attn_norm", "scale"), _same),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), _same),
}
TOP_LAYOUT: dict[str, tuple[tuple[str, ...], Transform]] = {
    "model.embed_tokens.weight": (("embedding",), _same),
    "model.norm.weight": (("final_norm", "scale"), _same),
    "lm_head.weight": (("lm_head",), _t),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints carry; recomputed from the config."""


def hf_layout(cfg: ModelConfig) -> dict[str, tuple[tuple, Transform, int | None]]:
    """HF tensor name -> (path in the model state, layout transform, row of the stacked layer parameter or None)
    for every tensor ``cfg`` needs."""
    layout = {}
    for name, (path, fn) in TOP_LAYOUT.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        layout[name] = (path, fn, None)
    for i in range(cfg.n_layers):
        for name, (path, fn) in LAYER_LAYOUT.items():
            layout[f"model.layers.{i}.{name}"] = (("layers",) + path, fn, i)
    return layout


_set_row_in_place = jax.jit(lambda stacked, row, value: stacked.at[row].set(value), donate_argnums=0)
"""One layer's tensor into its row of a stacked parameter, updating the buffer in place (no second copy)."""


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load_hf(path: str | Path, cfg: ModelConfig | None = None, dtype: str | None = None) -> Llama:
    """The model of a local HF ``LlamaForCausalLM`` folder (config.json + one or many *.safetensors)."""
    path = Path(path)
    cfg = cfg or from_hf_config(path)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}: expected a Hugging Face LlamaForCausalLM folder")
    layout = hf_layout(cfg)
    abstract = abstract_model(cfg)
    graphdef, state = nnx.split(abstract)
    tree = nnx.to_pure_dict(state)
    expected_shapes = {name: _get(tree, p).shape[0 if row is None else 1:] for name, (p, _, row) in layout.items()}
    stacked: dict[tuple, jax.Array] = {}  # path -> the stacked parameter being filled
    found, unexpected = set(), []
    for file in files:
        try:
            handle = safe_open(str(file), framework="numpy")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
        with handle as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in layout:
                    unexpected.append(name)
                    continue
                p, fn, row = layout[name]
                raw = f.get_tensor(name)
                try:
                    value = fn(raw, cfg)
                except ValueError:
                    value = None
                if value is None or value.shape != expected_shapes[name]:
                    raise ValueError(f"{file.name}: tensor {name} has shape {tuple(raw.shape)}, which does not "
                                     f"match config.json (expected a tensor laid out as {expected_shapes[name]})")
                if row is None:
                    _set(tree, p, jnp.asarray(value, cfg.param_dtype))
                else:
                    if p not in stacked:
                        stacked[p] = jnp.zeros(_get(tree, p).shape, cfg.param_dtype)
                    stacked[p] = _set_row_in_place(stacked[p], row, jnp.asarray(value, cfg.param_dtype))
                found.add(name)
    missing = sorted(set(layout) - found)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint in {path} lacks tensors {missing[:5]}{more}")
    if unexpected:
        raise ValueError(f"checkpoint in {path} has tensors a LlamaForCausalLM of this config does not: "
                         f"{sorted(unexpected)[:5]}")
    for p, value in stacked.items():
        _set(tree, p, value)
    nnx.replace_by_pure_dict(state, tree)
    return nnx.merge(graphdef, state)


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def save_checkpoint(model: Llama, directory: str | Path) -> None:
    """Write the model's parameters with orbax (a directory that must not exist yet)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory, nnx.state(model, nnx.Param))
        ckpt.wait_until_finished()


def restore_checkpoint(cfg: ModelConfig, directory: str | Path) -> Llama:
    """The model of ``cfg`` with parameters read from an orbax checkpoint written by ``save_checkpoint``."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise ValueError(f"no orbax checkpoint at {directory}")
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    with ocp.StandardCheckpointer() as ckpt:
        try:
            state = ckpt.restore(directory, abstract_state)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise ValueError(f"orbax checkpoint at {directory} does not match model {cfg.name}: {e}") from None
    return nnx.merge(graphdef, state)
