"""Optional: our Hugging Face import against Hugging Face transformers itself (skipped without torch/transformers).

The other tests compare the engine with a hand-written numpy reference; this one is independent of it: a tiny random
``LlamaForCausalLM`` (GQA, Llama-3 RoPE scaling or tied embeddings) is written by ``save_pretrained`` and loaded
by ``mj.LLM``; ``score()`` must match HF's logits and greedy ``generate()`` HF's greedy ``generate``.

    pip install torch==2.13.0 transformers   # the local CPU wheel of torch; see docs or the README
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mooncake_jax as mj  # noqa: E402

VOCAB = 300
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {
    # rope_theta and the Llama-3 scaling as this transformers version writes them (v5: one "rope_parameters").
    "llama3_rope": dict(rope_theta=50000.0, rope_scaling=LLAMA3, tie_word_embeddings=False),
    # The same model with config.json in the older layout real checkpoints carry (top-level rope_theta and
    # rope_scaling), which every transformers version reads.
    "llama3_rope_v4_config": dict(rope_theta=50000.0, rope_scaling=LLAMA3, tie_word_embeddings=False),
    "tied_embeddings": dict(tie_word_embeddings=True),
}


def to_v4_layout(folder):
    """Rewrite a v5 ``rope_parameters`` config.json into top-level ``rope_theta`` + ``rope_scaling``."""
    file = folder / "config.json"
    cfg = json.loads(file.read_text())
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    file.write_text(json.dumps(cfg, indent=2))


def hf_checkpoint(folder, case):
    """A random tiny LlamaForCausalLM written with save_pretrained; returns the HF model (eval, float32)."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        initializer_range=0.15,  # larger than the default 0.02 so logits, and greedy choices, are not near-ties
        **CASES[case])
    torch.manual_seed(sum(map(ord, case)) % 1000)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # RMSNorm scales start at 1: make them random too so a misplaced scale shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    if case.endswith("_v4_config"):
        to_v4_layout(folder)
    return model


def expected_config(llm, hf_model):
    """Our config import reads HF's RoPE settings in either layout (v5 ``rope_parameters`` or the older keys)."""
    hf = hf_model.config
    rope = getattr(hf, "rope_parameters", None)  # transformers >= 5
    if rope:
        theta, scaled = rope["rope_theta"], rope.get("rope_type", "default") != "default"
    else:
        theta, scaled = hf.rope_theta, bool(getattr(hf, "rope_scaling", None))
    assert llm.config.rope_theta == theta and (llm.config.rope_scaling is not None) == scaled, (
        f"mj read rope_theta={llm.config.rope_theta}, rope_scaling={llm.config.rope_scaling}; HF has theta={theta}, "
        f"scaled={scaled} (transformers {transformers.__version__})")


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = hf_checkpoint(folder, request.param)
    return hf_model, mj.LLM(str(folder), prefill_chunk_size=64, max_batch=4)


def test_score_matches_hf_logits(pair):
    hf_model, llm = pair
    expected_config(llm, hf_model)
    tokens = np.random.default_rng(1).integers(0, VOCAB, 100).tolist()  # past the 64 of the llama3 scaling
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0].numpy()
    ours = llm.score(tokens)
    assert ours.shape == ref.shape
    rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert rel <= 1e-4, f"max relative error {rel:.2e}"


def test_greedy_generate_matches_hf(pair):
    hf_model, llm = pair
    expected_config(llm, hf_model)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 17, 40, 70)]  # ragged, decoded together by mj
    n_new = 16
    ours = llm.generate(prompts, max_new_tokens=n_new, temperature=0.0)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=n_new, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        eos = hf_model.config.eos_token_id
        if eos in want:  # HF pads after EOS; mj stops with EOS as the last output token
            want = want[: want.index(eos) + 1]
        assert got == want
