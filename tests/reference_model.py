"""An independent, naive LLaMA forward in float64 numpy, over Hugging Face tensor names and layouts.

Full recompute, no cache, no paging, no chunking: the reference every engine path is compared against. Written from
the architecture's definition (HF modeling_llama semantics), sharing no code with mooncake_jax.model.
"""

from __future__ import annotations

import math

import numpy as np


def hf_tensors_of(model) -> dict[str, np.ndarray]:
    """Our model's parameters converted to HF names and layouts (test-side conversion; layer i is row i of the
    stacked layer parameters)."""
    from flax import nnx

    cfg = model.cfg
    tree = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    f = lambda x: np.asarray(x, np.float64)
    out = {"model.embed_tokens.weight": f(tree["embedding"]), "model.norm.weight": f(tree["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = f(tree["lm_head"]).T
    for i in range(cfg.n_layers):
        layer = {part: {name: np.asarray(x)[i] for name, x in params.items()}
                 for part, params in tree["layers"].items()}
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = f(layer["attn"]["wq"]).reshape(cfg.d_model, -1).T
        out[p + "self_attn.k_proj.weight"] = f(layer["attn"]["wk"]).reshape(cfg.d_model, -1).T
        out[p + "self_attn.v_proj.weight"] = f(layer["attn"]["wv"]).reshape(cfg.d_model, -1).T
        out[p + "self_attn.o_proj.weight"] = f(layer["attn"]["wo"]).reshape(-1, cfg.d_model).T
        out[p + "mlp.gate_proj.weight"] = f(layer["mlp"]["w_gate"]).T
        out[p + "mlp.up_proj.weight"] = f(layer["mlp"]["w_up"]).T
        out[p + "mlp.down_proj.weight"] = f(layer["mlp"]["w_down"]).T
        out[p + "input_layernorm.weight"] = f(layer["attn_norm"]["scale"])
        out[p + "post_attention_layernorm.weight"] = f(layer["mlp_norm"]["scale"])
    return out


def rope_inv_freq(head_dim, theta, scaling=None):
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None:
        return inv
    factor, low, high, orig = scaling
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def reference_logits(w, tokens, *, n_layers, n_heads, n_kv_heads, head_dim, eps, theta, scaling=None, tied=False):
    """Logits [n, vocab] (float64) at every position of ``tokens``."""
    x = w["model.embed_tokens.weight"][np.asarray(tokens)].astype(np.float64)
    n = len(tokens)
    inv = rope_inv_freq(head_dim, theta, scaling)
    ang = np.arange(n)[:, None] * inv[None]  # [n, hd/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rot(v):  # v [heads, n, hd]
        half = v.shape[-1] // 2
        return v * cos + np.concatenate([-v[..., half:], v[..., :half]], -1) * sin

    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, n_heads, head_dim).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, n_kv_heads, head_dim).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, n_kv_heads, head_dim).transpose(1, 0, 2)
        q, k = rot(q), rot(k)
        rep = n_heads // n_kv_heads
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(head_dim) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(n, n_heads * head_dim)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    return x @ head.T


def reference_for(model):
    """A callable tokens -> float64 logits for one of our models (weights converted to HF layout)."""
    cfg = model.cfg
    w = hf_tensors_of(model)
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position)
    return lambda tokens: reference_logits(
        w, tokens, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        eps=cfg.norm_eps, theta=cfg.rope_theta, scaling=scaling, tied=cfg.tie_embeddings)


def reference_greedy(ref, prompt, n_new):
    tokens = list(prompt)
    for _ in range(n_new):
        tokens.append(int(np.argmax(ref(tokens)[-1])))
    return tokens[len(prompt):]


def random_prompts(lengths, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """Prompts of the given lengths with token ids drawn from ``seed`` (the tiny preset's vocabulary by default)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]
