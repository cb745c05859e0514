"""What warming up the prompt-logprobs programs costs at start and saves the first scoring request.

An evaluation harness scores with ``echo`` + ``logprobs`` (prompt log-probabilities): a prefill that keeps the
logits of every position, then their float32 log-softmax, programs of their own. Without them in the warm-up, the
first such request of each chunk shape waits for XLA. Each variant runs in a fresh process (no shared jit cache,
no persistent compilation cache) on the tiny preset with a prefill instance's settings (chunk ``--chunk``,
bucket factor 4): warm-up of the prefill programs without / with the prompt-logprobs ones (seconds, programs),
then the first prompt-logprobs request (``--prompt-len`` tokens) and the same request again. The limit to compare
with is the steady request time (nothing to compile): a warm first request should be near it.

    python benchmarks/echo_warmup.py --json results/echo_warmup.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402


def variant(prompt_logprobs_warmup: bool, chunk: int, prompt_len: int) -> dict:
    """In this process: warm up, then time two prompt-logprobs requests."""
    import numpy as np

    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.engine import Engine
    from mooncake_jax.model.llama import init_model
    from mooncake_jax.model.sequence import SamplingParams

    engine = Engine(init_model(get_config("tiny"), 0), prefill_chunk_size=chunk, bucket_factor=4)
    t = time.perf_counter()
    programs = engine.warmup(decode=False, blocks=False, prompt_logprobs=prompt_logprobs_warmup)
    warmup_s = time.perf_counter() - t
    prompt = np.random.default_rng(0).integers(3, 500, prompt_len).tolist()
    times = []
    for _ in range(2):
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=1))
        t = time.perf_counter()
        engine.admit(seq)
        engine.prefill(seq)
        times.append(time.perf_counter() - t)
        assert len(seq.prompt_logprobs) == prompt_len - 1
        engine.release(seq)
    return {"warmup_s": warmup_s, "programs": programs, "first_s": times[0], "again_s": times[1]}


def main() -> None:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--variant", choices=["with", "without"], default=None, help=argparse_hidden())
    args = p.parse_args()
    if args.variant is not None:
        print(json.dumps(variant(args.variant == "with", args.chunk, args.prompt_len)))
        return
    results = {**machine_info(), "chunk": args.chunk, "prompt_len": args.prompt_len,
               "load_avg_1m_start": os.getloadavg()[0]}
    for name in ("without", "with"):
        out = subprocess.run([sys.executable, __file__, "--variant", name, "--chunk", str(args.chunk),
                              "--prompt-len", str(args.prompt_len)], capture_output=True, text=True, check=True)
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        results.update({f"{key}_{name}_prompt_logprobs_warmup": value for key, value in figures.items()})
    results["steady_request_s"] = min(results["again_s_without_prompt_logprobs_warmup"],
                                      results["again_s_with_prompt_logprobs_warmup"])
    results["first_request_over_steady_with_warmup"] = (results["first_s_with_prompt_logprobs_warmup"]
                                                        / results["steady_request_s"])
    results["first_request_over_steady_without_warmup"] = (results["first_s_without_prompt_logprobs_warmup"]
                                                           / results["steady_request_s"])
    results["load_avg_1m_end"] = os.getloadavg()[0]
    write_json(results, args.json)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
