"""``mooncake-jax generate``: run the local engine on prompts (no cluster): text, or token ids with ``--token-ids``."""

from __future__ import annotations

import json
import sys
import time


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or local Hugging Face folder")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text (repeat for several prompts); with --token-ids, comma-separated token ids; "
                        "default: two random token-id prompts")
    p.add_argument("--token-ids", action="store_true", help="--prompt holds comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--pipeline-stages", type=int, default=1)
    p.add_argument("--prefill-chunk-size", type=int, default=512)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])


def run(args) -> int:
    import numpy as np

    from ..llm import LLM

    texts = args.prompt if args.prompt and not args.token_ids else None
    try:
        prompts = ([[int(t) for t in p.split(",") if t.strip()] for p in args.prompt]
                   if args.prompt and args.token_ids else None)
    except ValueError:
        print("mooncake-jax generate: --token-ids --prompt takes comma-separated integer token ids", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model, tensor_parallel=args.tensor_parallel, pipeline_stages=args.pipeline_stages,
                  prefill_chunk_size=args.prefill_chunk_size, dtype=args.dtype)
        if texts is not None:
            t = time.perf_counter()
            out = llm.generate(texts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, seed=args.seed)
            for text, new in zip(texts, out):
                print(json.dumps({"prompt": text, "text": new}))
            print(f"{time.perf_counter() - t:.2f} s (first call includes compilation)")
            return 0
        if prompts is None:
            rng = np.random.default_rng(args.seed)
            prompts = [rng.integers(0, llm.config.vocab_size, n).tolist() for n in (24, 40)]
        t = time.perf_counter()
        out = llm.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed)
        seconds = time.perf_counter() - t
    except ValueError as e:
        print(f"mooncake-jax generate: {e}", file=sys.stderr)
        return 2
    for prompt, tokens in zip(prompts, out):
        print(json.dumps({"prompt_tokens": len(prompt), "new_tokens": tokens}))
    n = sum(len(o) for o in out)
    print(f"{n} tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s, first call includes compilation)")
    return 0
