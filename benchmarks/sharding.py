"""What crosses stage boundaries under chunked pipeline parallelism (CPP), and chunk-step time on this CPU.

1. Bytes (computed) for 8K to 128K-token prompts on the ``llama2-70b`` preset over X = 4 devices:
   - CPP with X stages: each token's hidden state (d x 2 bytes in bf16) crosses each of the X - 1 stage boundaries
     once: ``(X - 1) * n * d * 2`` for the prompt, ``(X - 1) * chunk * d * 2`` per chunk;
   - per-layer sequence parallelism (ring attention over X devices, the alternative the Mooncake paper rejects):
     at every layer every device receives the K and V of the other devices' tokens:
     ``layers * n * 2 * kv_heads * head_dim * 2 * (X - 1)``.
2. Measured on this CPU (8 fake devices over its real cores): prefill time per pipeline step for the ``tiny``
   preset with 1, 2 and 4 stages, a prompt of ``--chunks`` chunks (C + S - 1 steps each).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/sharding.py --json results/sharding.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402


def boundary_bytes(cfg, n_tokens: int, devices: int, chunk: int) -> dict:
    cpp_prompt = (devices - 1) * n_tokens * cfg.d_model * 2
    sp_prompt = cfg.n_layers * n_tokens * 2 * cfg.n_kv_heads * cfg.head_dim * 2 * (devices - 1)
    return {"cpp_bytes_per_chunk": (devices - 1) * min(chunk, n_tokens) * cfg.d_model * 2,
            "cpp_bytes_prompt": cpp_prompt, "seqpar_bytes_prompt": sp_prompt,
            "seqpar_over_cpp": round(sp_prompt / cpp_prompt, 2)}


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--devices", type=int, default=4, help="stages (CPP) = devices (sequence parallelism)")
    p.add_argument("--chunk", type=int, default=8192, help="CPP chunk size for the 70B figures")
    p.add_argument("--chunks", type=int, default=8, help="chunks of the measured tiny prompt")
    p.add_argument("--tiny-chunk", type=int, default=128)
    args = p.parse_args()

    import mooncake_jax as mj
    from mooncake_jax.model.config import PRESETS
    from mooncake_jax.model.measure import prefill_seconds

    res = dict(machine_info())
    cfg = PRESETS["llama2-70b"]
    for n in (8192, 16384, 32768, 65536, 131072):
        for key, value in boundary_bytes(cfg, n, args.devices, args.chunk).items():
            res[f"llama2_70b_{n // 1024}k_{key}"] = value

    prompt_len = args.chunks * args.tiny_chunk
    prompt = np.random.default_rng(0).integers(0, 512, prompt_len).tolist()
    for stages in tqdm((1, 2, 4), desc="pipeline stages"):
        llm = mj.LLM("tiny", pipeline_stages=stages, prefill_chunk_size=args.tiny_chunk, max_batch=1)
        dt = min(prefill_seconds(llm.engine, prompt) for _ in range(4))  # the first run compiles
        steps = args.chunks + stages - 1
        res[f"tiny_{stages}stage_prefill_s"] = round(dt, 4)
        res[f"tiny_{stages}stage_steps"] = steps
        res[f"tiny_{stages}stage_s_per_step"] = round(dt / steps, 5)
    res["tiny_prompt_tokens"] = prompt_len
    res["tiny_chunk_tokens"] = args.tiny_chunk
    write_json(res, args.json)


if __name__ == "__main__":
    main()
