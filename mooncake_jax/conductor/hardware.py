"""Built-in hardware profiles and model shapes: datasheet figures turned into instance cost models.

A simulated cluster (and a real one whose instances have not been profiled) needs prefill, decode and transfer
times without measuring anything. They follow from a few public figures per node and per model, scaled by a
stated efficiency: prefill is compute-bound (FAST'25 FLOP form at ``peak * prefill_efficiency``), a decode step
is memory-bound (weights plus KV read at ``hbm_bandwidth * decode_efficiency``, plus the per-request matmuls).

The model shapes here mirror the engine's presets (``mooncake_jax/model/config.py``; a test checks they agree)
so that the Conductor and the simulator never import JAX.
"""

from __future__ import annotations

import dataclasses

from mooncake_jax.conductor.costs import DecodeCost, InstanceCosts, PrefillCost

GB = 1e9
TB = 1e12


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The figures of a LLaMA-architecture model that its serving costs depend on."""

    name: str
    layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    dtype_bytes: int = 2

    @classmethod
    def from_model_config(cls, cfg) -> "ModelShape":
        """From the engine's ``ModelConfig`` (or anything with the same attribute names)."""
        import numpy as np

        return cls(name=cfg.name, layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                   n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, ffn_dim=cfg.ffn_dim,
                   vocab_size=cfg.vocab_size, dtype_bytes=np.dtype(cfg.param_dtype).itemsize)

    @property
    def kv_bytes_per_token(self) -> int:
        """layers * 2 (K, V) * kv_heads * head_dim * bytes: 320 KiB for a 70B model in bf16."""
        return self.layers * 2 * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def param_count(self) -> int:
        d, hd = self.d_model, self.head_dim
        per_layer = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * d * self.ffn_dim + 2 * d
        return 2 * self.vocab_size * d + self.layers * per_layer + d

    @property
    def param_bytes(self) -> int:
        return self.param_count * self.dtype_bytes


MODEL_SHAPES: dict[str, ModelShape] = {
    "llama2-7b": ModelShape("llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama2-70b": ModelShape("llama2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
}


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One serving node (an instance) as its datasheet describes it; all figures are node totals.

    ``prefill_efficiency`` is the fraction of peak FLOP/s a long prefill reaches (model FLOPs utilisation);
    ``decode_efficiency`` the fraction of HBM bandwidth a decode step reaches. ``source`` says where the figures
    come from and which ones are assumptions.
    """

    name: str
    chips: int
    peak_flops_per_s: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    host_to_device_bytes_per_s: float
    nic_bytes_per_s: float
    prefill_efficiency: float = 0.5
    decode_efficiency: float = 0.7
    cost_per_hour: float = 0.0
    kv_memory_fraction: float = 0.9
    source: str = ""

    def costs(self, model: ModelShape) -> InstanceCosts:
        """This node serving ``model``: prefill by FLOPs, decode by bytes read, KV capacity by HBM left over."""
        effective_bw = self.hbm_bytes_per_s * self.decode_efficiency
        effective_flops = self.peak_flops_per_s * self.prefill_efficiency
        kv_memory = self.hbm_bytes * self.kv_memory_fraction - model.param_bytes
        if kv_memory <= 0:
            raise ValueError(f"{model.name} ({model.param_bytes / GB:.0f} GB of weights) does not fit on "
                             f"{self.name} ({self.hbm_bytes / GB:.0f} GB of HBM)")
        decode = DecodeCost((model.param_bytes / effective_bw, 2.0 * model.param_count / effective_flops,
                             model.kv_bytes_per_token / effective_bw))
        return InstanceCosts(
            name=f"{self.name}/{model.name}",
            prefill=PrefillCost.fast25(model.layers, model.d_model, effective_flops),
            decode=decode,
            kv_bytes_per_token=model.kv_bytes_per_token,
            nic_bytes_per_s=self.nic_bytes_per_s,
            kv_capacity_tokens=int(kv_memory // model.kv_bytes_per_token),
            cost_per_hour=self.cost_per_hour,
            hardware=self.name,
        )


_PRICE_NOTE = "cost per hour: approximate 2024-25 cloud list price, an assumption to override"

HARDWARE: dict[str, HardwareProfile] = {
    "8xA800": HardwareProfile(
        "8xA800", 8, 8 * 312 * TB, 8 * 80 * GB, 8 * 2.039 * TB, 128 * GB, 100 * GB, cost_per_hour=16.0,
        source="FAST'25 Table 1 (8x312 TFLOP/s bf16, 128 GB/s host-to-device, 800 Gbps NIC); A800 SXM "
               f"datasheet (80 GB HBM2e, 2.039 TB/s); {_PRICE_NOTE}"),
    "8xH800": HardwareProfile(
        "8xH800", 8, 8 * 989 * TB, 8 * 80 * GB, 8 * 3.35 * TB, 256 * GB, 400 * GB, cost_per_hour=24.0,
        source="H800 SXM datasheet (989 TFLOP/s dense bf16, 80 GB HBM3, 3.35 TB/s); assumed: host-to-device half "
               f"of PCIe Gen5 x16 per GPU (as FAST'25's A800 figure is of Gen4), 8x400 Gbps NIC; {_PRICE_NOTE}"),
    "8xH200": HardwareProfile(
        "8xH200", 8, 8 * 989 * TB, 8 * 141 * GB, 8 * 4.8 * TB, 256 * GB, 400 * GB, cost_per_hour=32.0,
        source="H200 SXM datasheet (989 TFLOP/s dense bf16, 141 GB HBM3e, 4.8 TB/s); assumed: host-to-device half "
               f"of PCIe Gen5 x16 per GPU, 8x400 Gbps NIC; {_PRICE_NOTE}"),
    "tpu-v5e-8": HardwareProfile(
        "tpu-v5e-8", 8, 8 * 197 * TB, 8 * 16 * GB, 8 * 819 * GB, 128 * GB, 25 * GB, cost_per_hour=9.6,
        source="Cloud TPU v5e spec (197 TFLOP/s bf16, 16 GB HBM2, 819 GB/s per chip; $1.20 per chip-hour); "
               "assumed: 16 GB/s host-to-device per chip, 200 Gbps host network"),
    "tpu-v6e-8": HardwareProfile(
        "tpu-v6e-8", 8, 8 * 918 * TB, 8 * 32 * GB, 8 * 1640 * GB, 256 * GB, 100 * GB, cost_per_hour=21.6,
        source="Cloud TPU v6e (Trillium) spec (918 TFLOP/s bf16, 32 GB HBM, 1640 GB/s per chip; $2.70 per "
               "chip-hour); assumed: 32 GB/s host-to-device per chip, 800 Gbps host network"),
}


def instance_costs(hardware: str, model: str) -> InstanceCosts:
    """Costs of a built-in hardware profile serving a built-in model shape, both by name."""
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware profile {hardware!r}; built-in: {sorted(HARDWARE)}")
    if model not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {model!r}; built-in: {sorted(MODEL_SHAPES)}")
    return HARDWARE[hardware].costs(MODEL_SHAPES[model])
