"""An unrolled (CPU) stage's decode copy (``ModelConfig.decode_weights``): its weight matrices transposed
(``llama.OUTPUT_MAJOR``), used by steps of one token per sequence only, and giving the float64 reference's logits."""

import numpy as np
import pytest
from flax import nnx

from mooncake_jax.model.attention import PagedBatch
from mooncake_jax.model.config import PRESETS
from mooncake_jax.model.kv_cache import allocate_kv
from mooncake_jax.model.llama import OUTPUT_MAJOR, Stage, init_model
from reference_model import reference_for

MATRICES = [("attn", "wq"), ("attn", "wk"), ("attn", "wv"), ("attn", "wo"), ("mlp", "w_gate"), ("mlp", "w_up"),
            ("mlp", "w_down")]


def _prefill_then_step(stage, cfg, tokens):
    """Logits of a prefill of ``tokens[:-1]`` (every position) and of one decode step of ``tokens[-1]`` after it."""
    t = len(tokens) - 1
    kv = allocate_kv(cfg, 8, n_layers=cfg.n_layers)
    slots = cfg.block_size + np.arange(t + 1, dtype=np.int32)  # pages 1.. in order (page 0 is scratch)
    prefill = PagedBatch(np.zeros((1, 0), np.int32), np.zeros(1, np.int32), slots[None, :t])
    logits, kv = stage(np.asarray(tokens[:t], np.int32)[None], np.arange(t, dtype=np.int32)[None], kv, prefill)
    pages = np.arange(1, 1 + -(-t // cfg.block_size), dtype=np.int32)[None]
    step = PagedBatch(pages, np.full(1, t, np.int32), slots[None, t:])
    last, _ = stage(np.asarray(tokens[t:], np.int32)[None], np.full((1, 1), t, np.int32), kv, step,
                    np.zeros(1, np.int32))
    return np.asarray(logits[0], np.float64), np.asarray(last[0], np.float64)


def test_decode_copy_holds_the_weights_transposed_with_their_axes():
    cfg = PRESETS["tiny"]
    model = init_model(cfg, seed=3)
    stage = Stage(model, 0, cfg.n_layers, scan=False)
    stacked = nnx.to_pure_dict(nnx.state(model.layers))
    for layer in range(cfg.n_layers):
        canonical = nnx.to_pure_dict(nnx.state(stage.layers[layer]))
        decode = nnx.to_pure_dict(nnx.state(stage.decode_layers[layer]))
        for part, name in MATRICES:
            w = np.asarray(stacked[part][name][layer])
            np.testing.assert_array_equal(np.asarray(canonical[part][name]), w)
            np.testing.assert_array_equal(np.asarray(decode[part][name]), np.transpose(w, OUTPUT_MAJOR[name]))
    assert stage.decode_layers[0].attn.wo.get_metadata()["out_sharding"] == ("embed", "heads", "head_dim")
    assert stage.decode_layers[0].mlp.w_up.get_metadata()["out_sharding"] == ("mlp", "embed")
    np.testing.assert_array_equal(np.asarray(stage.decode_lm_head[...]), np.asarray(model.lm_head[...]).T)
    assert stage.decode_lm_head.get_metadata()["out_sharding"] == ("vocab", "embed")


def test_no_decode_copy_when_canonical_or_scanned():
    cfg = PRESETS["tiny"]
    canonical = Stage(init_model(cfg.replace(decode_weights="canonical"), seed=3), 0, cfg.n_layers, scan=False)
    scanned = Stage(init_model(cfg, seed=3), 0, cfg.n_layers, scan=True)
    for stage in (canonical, scanned):
        assert stage.decode_layers is None and stage.decode_lm_head is None


def test_decode_steps_run_on_the_copy_and_match_the_reference():
    cfg = PRESETS["tiny"]
    model = init_model(cfg, seed=3)
    tokens = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 22))
    ref = reference_for(model)(tokens)  # [22, vocab] float64
    stage = Stage(model, 0, cfg.n_layers, scan=False)
    prefill, step = _prefill_then_step(stage, cfg, tokens)
    np.testing.assert_allclose(prefill, ref[:-1], atol=2e-4, rtol=0)
    np.testing.assert_allclose(step, ref[-1], atol=2e-4, rtol=0)
    plain = Stage(init_model(cfg.replace(decode_weights="canonical"), seed=3), 0, cfg.n_layers, scan=False)
    np.testing.assert_allclose(step, _prefill_then_step(plain, cfg, tokens)[1], atol=2e-5, rtol=0)

    # The one-token step reads the decode copy and only it: zeroing that copy's down projections changes the
    # step's logits and leaves the prefill's as they were.
    for layer in stage.decode_layers:
        layer.mlp.w_down[...] = np.zeros(layer.mlp.w_down.shape, np.float32)
    prefill_z, step_z = _prefill_then_step(stage, cfg, tokens)
    np.testing.assert_array_equal(prefill_z, prefill)
    assert np.abs(step_z - step).max() > 1e-2


def test_auto_keeps_the_copy_for_small_models_only():
    """``auto`` (the default) doubles the weights of a small model only: a 7B model on a CPU host keeps one copy."""
    assert PRESETS["tiny"].decode_weights == "auto" and PRESETS["tiny"].keeps_decode_copy()
    assert PRESETS["small"].keeps_decode_copy()
    assert not PRESETS["llama2-7b"].keeps_decode_copy()
    assert PRESETS["llama2-7b"].replace(decode_weights="output_major").keeps_decode_copy()
    assert not PRESETS["small"].replace(decode_weights="canonical").keeps_decode_copy()


def test_unknown_decode_weights_is_refused():
    with pytest.raises(ValueError, match="decode_weights 'row_major'.*allowed: auto, output_major, canonical"):
        PRESETS["tiny"].replace(decode_weights="row_major")
