"""Hugging Face import (a random checkpoint written here with safetensors) and the orbax round trip."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import mooncake_jax as mj
from mooncake_jax.model.config import PRESETS
from mooncake_jax.model.llama import abstract_model, init_model, param_bytes
from mooncake_jax.model.weights import restore_checkpoint, save_checkpoint
from reference_model import reference_logits

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
}


def random_hf_tensors(cfg, seed=0):
    rng = np.random.default_rng(seed)
    d, v, f, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], d_head(cfg)
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    r = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = r(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = r(h * hd, d)
        w[p + "self_attn.k_proj.weight"] = r(kv * hd, d)
        w[p + "self_attn.v_proj.weight"] = r(kv * hd, d)
        w[p + "self_attn.o_proj.weight"] = r(d, h * hd)
        w[p + "mlp.gate_proj.weight"] = r(f, d)
        w[p + "mlp.up_proj.weight"] = r(f, d)
        w[p + "mlp.down_proj.weight"] = r(d, f)
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    return w


def d_head(cfg):
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def write_checkpoint(folder, cfg, tensors, shards=2):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))


def hf_reference(cfg, w, tokens):
    s = cfg.get("rope_scaling")
    scaling = None if not s else (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                                  s["original_max_position_embeddings"])
    return reference_logits(w, tokens, n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                            n_kv_heads=cfg["num_key_value_heads"], head_dim=d_head(cfg), eps=cfg["rms_norm_eps"],
                            theta=cfg["rope_theta"], scaling=scaling, tied=cfg["tie_word_embeddings"])


def rope_parameters_layout(cfg):
    """The same config as transformers >= 5 writes it: theta and scaling in one "rope_parameters" block."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    out["rope_parameters"] = {"rope_theta": cfg["rope_theta"], **cfg["rope_scaling"]}
    return out


@pytest.mark.parametrize("tied, layout", [(False, "classic"), (True, "classic"), (False, "rope_parameters")])
def test_hf_import_matches_reference(tmp_path, tied, layout):
    cfg = {**HF_CONFIG, "tie_word_embeddings": tied}
    w = random_hf_tensors(cfg)
    write_checkpoint(tmp_path / "ckpt", rope_parameters_layout(cfg) if layout != "classic" else cfg, w)
    llm = mj.LLM(str(tmp_path / "ckpt"), block_size=16)
    assert llm.config.rope_scaling is not None and llm.config.tie_embeddings == tied
    assert llm.config.rope_theta == 50000.0
    tokens = np.random.default_rng(1).integers(0, 300, 40).tolist()
    ref = hf_reference(cfg, {k: v.astype(np.float64) for k, v in w.items()}, tokens)
    got = llm.score(tokens)
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) <= 1e-4
    greedy = llm.generate([tokens[:10]], max_new_tokens=5)[0]
    seq = tokens[:10]
    for _ in range(5):
        seq.append(int(np.argmax(hf_reference(cfg, w, seq)[-1])))
    assert greedy == seq[10:]


def test_mismatched_checkpoints_raise_clear_errors(tmp_path):
    w = random_hf_tensors(HF_CONFIG)
    with pytest.raises(ValueError, match="not a preset"):
        mj.LLM(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        mj.LLM(str(empty))
    missing = dict(w)
    del missing["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint(tmp_path / "missing", HF_CONFIG, missing)
    with pytest.raises(ValueError, match="lacks tensors.*up_proj"):
        mj.LLM(str(tmp_path / "missing"))
    wrong = {**w, "model.layers.0.self_attn.k_proj.weight": np.zeros((8, 64), np.float32)}
    write_checkpoint(tmp_path / "wrong", HF_CONFIG, wrong)
    with pytest.raises(ValueError, match="k_proj.*does not match config.json"):
        mj.LLM(str(tmp_path / "wrong"))
    bad_json = tmp_path / "badjson"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        mj.LLM(str(bad_json))
    corrupt = tmp_path / "corrupt"
    write_checkpoint(corrupt, HF_CONFIG, w, shards=1)
    next(corrupt.glob("*.safetensors")).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        mj.LLM(str(corrupt))


def test_orbax_round_trip_is_bit_exact(tmp_path):
    cfg = PRESETS["tiny"].replace(dtype="bfloat16")
    model = init_model(cfg, seed=3)
    save_checkpoint(model, tmp_path / "ck")
    back = restore_checkpoint(cfg, tmp_path / "ck")
    from flax import nnx
    import jax

    a = jax.tree.leaves(nnx.state(model, nnx.Param))
    b = jax.tree.leaves(nnx.state(back, nnx.Param))
    assert len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
                                    for x, y in zip(a, b))
    with pytest.raises(ValueError, match="no orbax checkpoint"):
        restore_checkpoint(cfg, tmp_path / "absent")
    with pytest.raises(ValueError, match="does not match"):
        restore_checkpoint(PRESETS["tiny"].replace(n_layers=2, dtype="bfloat16"), tmp_path / "ck")


def test_dummy_weights_are_deterministic_from_the_seed():
    a, b, c = (init_model(PRESETS["tiny"], seed=s) for s in (5, 5, 6))
    wa, wb, wc = (np.asarray(m.layers.mlp.w_up[...]) for m in (a, b, c))
    assert wa.shape[0] == 4  # stacked: one row per layer
    assert np.array_equal(wa, wb) and not np.array_equal(wa, wc)
    assert not np.array_equal(wa[0], wa[1])  # every layer draws its own weights


def test_70b_presets_build_abstractly_with_the_paper_sizes():
    for name, vocab in (("llama2-70b", 32000), ("llama3-70b", 128256)):
        cfg = PRESETS[name]
        model = abstract_model(cfg)
        assert param_bytes(model) == cfg.param_count() * 2
        assert 68e9 < cfg.param_count() < 71.5e9
        assert cfg.kv_bytes_per_token() == 320 * 1024  # 80 * 2 * 8 * 128 * 2 bytes
        assert cfg.kv_bytes_per_block() == 160 * 1024 * 1024
        assert model.embedding.shape == (vocab, 8192)
