"""Model configurations: the LLaMA architecture's hyper-parameters and the named presets.

One frozen dataclass describes a model completely (shapes, RoPE, norms, special tokens, default dtype), so a
preset, a Hugging Face ``config.json`` and an abstract 70B build all go through the same validation. Sizes that
the rest of the system plans with (parameter bytes, KV bytes per token and per block) are derived here once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
"""Parameter/KV dtypes the engine supports, by name."""


ATTENTION_IMPLS = ("auto", "xla", "pallas", "cpu_kernel")
"""Implementations behind the attention seam (``model/attention.py``): the portable pure-JAX one, the Pallas
kernels (interpret mode on CPU), the C++ kernels for XLA:CPU (``model/cpu_kernel``), and ``auto``: on the CPU
backend the C++ kernels where they build (else xla), on a GPU of compute capability >= 9.0 (Hopper) the Pallas
kernels where they compile for the cache's shape (``attention.pallas_fits``), on other GPUs and on TPU xla
(``attention.resolve_impl``)."""


DECODE_WEIGHTS = ("auto", "output_major", "canonical")
"""Values of ``ModelConfig.decode_weights``: whether an unrolled (CPU) stage keeps a second, transposed copy of its
weight matrices for its decode programs (``llama.OUTPUT_MAJOR``; 0.84x the wall time of a ``small`` decode step at
batch 32, 0.86x at batch 8 on a 2-core Xeon) or decodes on the canonical copy. The copy costs the stage's layer
weights and LM head once more: +0.4 GB for ``small`` in float32, about +137 GB for a ``llama2-70b`` shape in
bfloat16. ``auto`` (the default) keeps it only for a model whose weights take at most ``DECODE_COPY_AUTO_BYTES``, so
a large model on a CPU host does not need twice its memory unasked. Scanned stages (GPU/TPU) never hold it."""

DECODE_COPY_AUTO_BYTES = 2 << 30
"""Largest model (bytes of weights) for which ``decode_weights="auto"`` keeps the decode copy: ``small`` and the
test presets, not a 7B model (28 GB in float32)."""


def resolve_dtype(name) -> np.dtype:
    """The numpy dtype for a dtype name in ``DTYPES`` (or an already resolved dtype); ValueError otherwise."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; allowed: {sorted(DTYPES)}")
        return np.dtype(DTYPES[name])
    dt = np.dtype(name)
    if dt not in {np.dtype(v) for v in DTYPES.values()}:
        raise ValueError(f"unsupported dtype {dt}; allowed: {sorted(DTYPES)}")
    return dt


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style RoPE frequency scaling (long-context extension)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a LLaMA-architecture decoder."""

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    block_size: int = 16
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    attention: str = "auto"  # implementation behind the attention seam: one of ATTENTION_IMPLS
    decode_weights: str = "auto"  # an unrolled stage's decode weight copy, see DECODE_WEIGHTS

    def __post_init__(self):
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                    "max_seq_len", "block_size")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim must be even for RoPE, got {self.head_dim}")
        resolve_dtype(self.dtype)
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"{self.name}: unknown attention implementation {self.attention!r}; "
                             f"allowed: {', '.join(ATTENTION_IMPLS)}")
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ValueError(f"{self.name}: unknown decode_weights {self.decode_weights!r}; "
                             f"allowed: {', '.join(DECODE_WEIGHTS)}")
        for tok in ("bos_token_id", "eos_token_id"):
            value = getattr(self, tok)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{self.name}: {tok} {value} is outside the vocabulary [0, {self.vocab_size})")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def param_dtype(self) -> np.dtype:
        return resolve_dtype(self.dtype)

    def param_count(self) -> int:
        d, h, kv, hd, f = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim
        per_layer = d * hd * (2 * h + 2 * kv) + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * per_layer + d + head

    def keeps_decode_copy(self) -> bool:
        """Whether an unrolled stage of this model holds the output-major decode copy (``DECODE_WEIGHTS``)."""
        if self.decode_weights == "auto":
            return self.param_count() * self.param_dtype.itemsize <= DECODE_COPY_AUTO_BYTES
        return self.decode_weights == "output_major"

    def matmul_params_per_token(self) -> int:
        """Weights touched by one token's matmuls in the decoder layers (no embedding gather, no LM head)."""
        d, h, kv, hd, f = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim
        return self.n_layers * (d * hd * (2 * h + 2 * kv) + 3 * d * f)

    def kv_bytes_per_token(self, dtype=None) -> int:
        """Layers x 2 (K and V) x kv_heads x head_dim x bytes: 320 KiB for a 70B model in bfloat16."""
        itemsize = resolve_dtype(dtype or self.dtype).itemsize
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * itemsize

    def kv_bytes_per_block(self, dtype=None) -> int:
        return self.block_size * self.kv_bytes_per_token(dtype)

    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one KV block as the pool stores it: (layers, K/V, block_size, kv_heads, head_dim)."""
        return (self.n_layers, 2, self.block_size, self.n_kv_heads, self.head_dim)

    def prefill_flops(self, n_tokens: int, prefix_tokens: int = 0, lm_head_tokens: int = 1) -> float:
        """Model FLOPs of prefilling ``n_tokens`` new tokens after ``prefix_tokens`` cached ones.

        Matmuls count 2 FLOPs per multiply-add; causal attention counts only the unmasked half of the new
        tokens' own scores, plus the full rectangle over the prefix.
        """
        n, p = n_tokens, prefix_tokens
        dense = 2.0 * n * self.matmul_params_per_token()
        attn_pairs = n * p + n * (n + 1) / 2
        attn = 2.0 * 2.0 * attn_pairs * self.n_heads * self.head_dim * self.n_layers
        head = 2.0 * lm_head_tokens * self.d_model * self.vocab_size
        return dense + attn + head


def _preset(**kw) -> ModelConfig:
    return ModelConfig(**kw)


PRESETS: dict[str, ModelConfig] = {
    # Test-sized: GQA (8 query heads over 2 KV heads), 4 layers so 2 or 4 pipeline stages fit, heads divisible
    # by 8 for tensor parallelism over 8 devices. No EOS: dummy weights would hit one at random.
    "tiny": _preset(name="tiny", vocab_size=512, d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16,
                    ffn_dim=256, max_seq_len=4096, block_size=16, eos_token_id=None),
    # About 100M parameters in the decoder and LM head (the CPU benchmark model; HF comparison in DESIGN.md).
    "small": _preset(name="small", vocab_size=32000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                     head_dim=64, ffn_dim=2048, max_seq_len=32768, block_size=16, eos_token_id=None),
    "llama2-7b": _preset(name="llama2-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                         n_kv_heads=32, head_dim=128, ffn_dim=11008, max_seq_len=4096, block_size=512,
                         dtype="bfloat16"),
    "llama2-70b": _preset(name="llama2-70b", vocab_size=32000, d_model=8192, n_layers=80, n_heads=64,
                          n_kv_heads=8, head_dim=128, ffn_dim=28672, max_seq_len=4096, block_size=512,
                          dtype="bfloat16"),
    # Llama-3.1-70B shape: 128K context through the Llama-3 RoPE frequency scaling.
    "llama3-70b": _preset(name="llama3-70b", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                          n_kv_heads=8, head_dim=128, ffn_dim=28672, max_seq_len=131072, rope_theta=500000.0,
                          rope_scaling=RopeScaling(), block_size=512, dtype="bfloat16", bos_token_id=128000,
                          eos_token_id=128001),
}


def from_hf_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from a Hugging Face ``LlamaForCausalLM`` ``config.json``."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json in {path}: expected a Hugging Face LlamaForCausalLM folder")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    archs = cfg.get("architectures") or []
    if archs and not any(a in ("LlamaForCausalLM", "MistralForCausalLM") for a in archs):
        raise ValueError(f"{file}: architecture {archs} is not supported; expected LlamaForCausalLM")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    absent = [k for k in required if k not in cfg]
    if absent:
        raise ValueError(f"{file} lacks {absent}")
    n_heads = cfg["num_attention_heads"]
    # transformers >= 5 writes one "rope_parameters" block (theta and scaling); older versions write a top-level
    # "rope_theta" and "rope_scaling".
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise ValueError(f"{file}: rope_scaling type {kind!r} is not supported; allowed: 'llama3' or none")
    if scaling:
        rope_scaling = RopeScaling(factor=float(scaling["factor"]),
                                   low_freq_factor=float(scaling["low_freq_factor"]),
                                   high_freq_factor=float(scaling["high_freq_factor"]),
                                   original_max_position=int(scaling["original_max_position_embeddings"]))
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return ModelConfig(
        name=str(path), vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads, ffn_dim=cfg["intermediate_size"],
        max_seq_len=cfg.get("max_position_embeddings", 4096), rope_theta=theta,
        rope_scaling=rope_scaling, norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype="bfloat16" if torch_dtype == "bfloat16" else "float32",
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
    )


def get_config(model: str | Path) -> ModelConfig:
    """A preset by name, or the config of a local Hugging Face folder."""
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.is_dir():
        return from_hf_config(path)
    raise ValueError(f"unknown model {str(model)!r}: not a preset ({', '.join(PRESETS)}) "
                     f"and not a local Hugging Face folder")
