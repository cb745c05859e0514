"""mooncake-jax against Hugging Face transformers (torch) on the same checkpoint, same CPUs, same run.

DESIGN.md section 5: on a 125M LLaMA (d 768, 12 layers, 12 heads, 4 KV heads, FFN 2048, vocab 32000, float32)
HF prefills 2048 tokens at about 740 tokens/s and decodes greedily at about 37 tokens/s at batch 1 and 135 at
batch 8; ours must be at least as fast. This script:

1. writes a random checkpoint of that shape with ``LlamaForCausalLM(...).save_pretrained`` (a temporary folder),
2. loads it in transformers (torch, CPU, eval, inference mode) and in mooncake-jax (``mj.LLM(folder, ...)``),
3. checks they agree: logits of a 64-token prompt (max relative error = max |ours - HF| / max |HF|), the last
   logits of the 2048-token prefill, and greedy tokens of a few prompts (fraction of sequences equal, fraction of
   leading tokens that agree),
4. times, best of ``--repeats`` after warm-up, the two engines in alternating rounds (so both see the same
   background load): prefill of 2048 tokens (HF: one forward with a fresh KV cache computing only the last
   position's logits, as ``generate`` does) and greedy decode tokens/s at batch 1 and 8 after a 512-token prompt.
   HF decode is timed two ways and the faster is HF's figure: (a) ``model.generate(do_sample=False,
   max_new_tokens=N, min_new_tokens=N)`` with a stopping criterion that timestamps every step, decode time being
   last minus first timestamp (N - 1 decode forwards, generate's own loop and overheads, no prefill); (b) a manual
   loop of single-token forwards with ``DynamicCache`` and argmax. Ours: ``llm.engine.decode`` steps, as
   ``benchmarks/engine_cpu.py`` does,
5. reports both and the ratios ours / HF (``ratio_*`` > 1: ours is faster).

    pip install torch==2.13.0 transformers      # the local CPU wheel of torch (never a CUDA build)
    python benchmarks/hf_compare.py --json results/hf_compare.json
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, prefilled_sequences, write_json  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048)
"""The 125M LLaMA of DESIGN.md section 5 (the ``small`` preset's shape)."""


def require_hf():
    """torch and transformers, or exit saying what to install."""
    import importlib.util

    def present(name):
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    missing = [name for name in ("torch", "transformers") if not present(name)]
    if missing:
        sys.exit(f"hf_compare.py compares against Hugging Face transformers and needs torch and transformers; not "
                 f"installed: {', '.join(missing)} (neither is a dependency of mooncake-jax). Install torch's local "
                 f"CPU wheel first, then transformers: pip install torch==2.13.0 && pip install transformers")
    import torch
    import transformers

    return torch, transformers


def pause() -> None:
    """Let the other engine's worker threads stop spinning before timing this one."""
    time.sleep(0.2)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens for the prefill comparison")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per figure (best is reported)")
    p.add_argument("--parity-prompts", type=int, default=4)
    p.add_argument("--parity-tokens", type=int, default=16, help="greedy tokens per parity prompt")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="write the checkpoint here and keep it (default: a temporary folder, removed at the end)")
    args = p.parse_args()
    # A prefill instance's allocator settings (model/host_memory.py: one malloc arena, large blocks kept on the heap)
    # first, as in a process that serves prefills: glibc gives each thread its arena at its first allocation, and
    # torch's threads, made by the checkpoint's first ops, would otherwise take arenas that XLA's threads then share,
    # mapping the prefill's temporaries afresh each call. Both libraries run under them. (A decode instance keeps
    # an arena per thread; here the decode figures pay the one arena, 5-10% at batch 1 on an AMD EPYC.)
    from mooncake_jax.model.host_memory import share_one_arena

    share_one_arena()
    torch, transformers = require_hf()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    import mooncake_jax as mj
    from mooncake_jax.model.sequence import SamplingParams

    batches = [int(x) for x in args.batches.split(",")]
    res = dict(machine_info(), torch=torch.__version__, transformers=transformers.__version__,
               torch_threads=torch.get_num_threads(), repeats=args.repeats, context=args.context,
               decode_steps=args.decode_steps, loadavg_1m_start=round(os.getloadavg()[0], 2))
    bar = tqdm(total=5 + len(batches), desc="hf_compare", unit="stage")
    tmp = None
    if args.checkpoint is None:
        tmp = tempfile.TemporaryDirectory(prefix="hf_compare_")
        folder = Path(tmp.name)
    else:
        folder = args.checkpoint
        folder.mkdir(parents=True, exist_ok=True)
    try:
        # ---- 1. the checkpoint ------------------------------------------------------------------------------------
        bar.set_postfix_str("writing checkpoint")
        max_pos = max(4096, args.prefill + 64, args.context + (args.repeats + 2) * args.decode_steps + 64)
        hf_cfg = transformers.LlamaConfig(**SHAPE, max_position_embeddings=max_pos, tie_word_embeddings=False)
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32)
        hf.save_pretrained(folder, safe_serialization=True)
        res["params_m"] = round(sum(t.numel() for t in hf.parameters()) / 1e6, 1)
        del hf
        bar.update()

        # ---- 2. both engines load the same folder ------------------------------------------------------------------
        bar.set_postfix_str("loading")
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        res["hf_attn_implementation"] = hf.config._attn_implementation
        bs = 16  # mj's block size for a Hugging Face folder
        pages = 1 + max(batches) * ((args.context + (args.repeats + 2) * args.decode_steps) // bs + 2) \
            + args.prefill // bs + 64
        llm = mj.LLM(str(folder), prefill_chunk_size=args.prefill, max_batch=max(batches), num_pages=pages)
        eng = llm.engine
        keep_kw = "logits_to_keep" if "logits_to_keep" in inspect.signature(hf.forward).parameters \
            else "num_logits_to_keep"
        res["hf_logits_kw"] = keep_kw
        # transformers 5.2x renamed forward's past_key_values to cache (the old name warns, then goes in 5.40)
        cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        bar.update()

        # ---- 3. parity -----------------------------------------------------------------------------------------
        bar.set_postfix_str("parity")
        rng = np.random.default_rng(0)
        vocab = SHAPE["vocab_size"]
        tokens = rng.integers(0, vocab, 64).tolist()
        with torch.inference_mode():
            ref = hf(torch.tensor([tokens])).logits[0].numpy()
        ours = llm.score(tokens)
        res["parity_logits64_max_rel_err"] = float(f"{rel_err(ours, ref):.3g}")
        res["parity_logits64_max_abs_err"] = float(f"{float(np.abs(ours - ref).max()):.3g}")
        res["parity_logits64_argmax_equal_frac"] = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
        n_new = args.parity_tokens
        lengths = [int(x) for x in np.linspace(8, 200, args.parity_prompts)]
        prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]  # ragged: ours decodes them together
        ours_out = llm.generate(prompts, max_new_tokens=n_new, temperature=0.0)
        eos = hf.config.eos_token_id
        seq_equal, lead = 0, 0
        for prompt, got in zip(prompts, ours_out):
            with torch.inference_mode():
                out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=n_new, pad_token_id=0)
            want = out[0, len(prompt):].tolist()
            if eos is not None and eos in want:  # HF pads after EOS; ours stops with EOS as the last token
                want = want[: want.index(eos) + 1]
            seq_equal += got == want
            k = 0
            while k < min(len(got), len(want)) and got[k] == want[k]:
                k += 1
            lead += k / max(len(got), len(want))
        res["parity_greedy_prompts"] = len(prompts)
        res["parity_greedy_tokens"] = n_new
        res["parity_greedy_seq_equal_frac"] = seq_equal / len(prompts)
        res["parity_greedy_leading_tokens_equal_frac"] = round(lead / len(prompts), 4)
        bar.update()

        # ---- 4a. prefill --------------------------------------------------------------------------------------
        bar.set_postfix_str(f"prefill {args.prefill}")
        n = args.prefill
        prompt = rng.integers(0, vocab, n).tolist()
        hf_ids = torch.tensor([prompt])
        last = {}

        def ours_prefill():
            seq = eng.new_sequence(prompt, SamplingParams(max_new_tokens=1))
            eng.admit(seq, cached_pages=[])  # no prefix-cache hit: the whole prompt is computed every time
            last["ours"] = eng.prefill(seq)
            eng.release(seq)

        def hf_prefill():
            with torch.inference_mode():
                out = hf(input_ids=hf_ids, use_cache=True, **{cache_kw: transformers.DynamicCache(), keep_kw: 1})
            last["hf"] = out.logits[0, -1].numpy()

        ours_t, hf_t = [], []
        for r in range(args.repeats + 1):  # round 0 is the warm-up (compilation for ours)
            pause()
            dt = timed(ours_prefill)
            if r:
                ours_t.append(dt)
            pause()
            dt = timed(hf_prefill)
            if r:
                hf_t.append(dt)
        res[f"ours_prefill_{n}_tok_s"] = round(n / min(ours_t), 1)
        res[f"hf_prefill_{n}_tok_s"] = round(n / min(hf_t), 1)
        res[f"ratio_prefill_{n}"] = round(min(hf_t) / min(ours_t), 3)
        res[f"parity_prefill_{n}_last_logits_max_rel_err"] = float(f"{rel_err(last['ours'], last['hf']):.3g}")
        bar.update()

        # ---- 4b. decode ---------------------------------------------------------------------------------------
        steps = args.decode_steps
        for b in batches:
            bar.set_postfix_str(f"decode b{b}")
            ctx_prompts = [rng.integers(3, vocab, args.context).tolist() for _ in range(b)]
            budget = 1 + (args.repeats + 2) * steps
            seqs = prefilled_sequences(eng, ctx_prompts, budget)
            ids = torch.tensor(ctx_prompts)
            with torch.inference_mode():
                cache = transformers.DynamicCache()
                out = hf(input_ids=ids, use_cache=True, **{cache_kw: cache, keep_kw: 1})
                nxt = out.logits[:, -1].argmax(-1)

            def ours_decode():
                for _ in range(steps):
                    eng.decode(seqs)

            def hf_loop():
                nonlocal nxt
                with torch.inference_mode():
                    for _ in range(steps):
                        o = hf(input_ids=nxt[:, None], use_cache=True, **{cache_kw: cache, keep_kw: 1})
                        nxt = o.logits[:, -1].argmax(-1)

            ours_t, loop_t = [], []
            for r in range(args.repeats + 1):  # both contexts grow by `steps` tokens a round, alike
                pause()
                dt = timed(ours_decode)
                if r:
                    ours_t.append(dt)
                pause()
                dt = timed(hf_loop)
                if r:
                    loop_t.append(dt)
            for seq in seqs:
                eng.release(seq)

            gen_t = []
            stamps: list[float] = []

            class Stamp(transformers.StoppingCriteria):
                """Called once per generated token (after the prefill's, then after every decode forward)."""

                def __call__(self, input_ids, scores, **kwargs):
                    stamps.append(time.perf_counter())
                    return torch.zeros(input_ids.shape[0], dtype=torch.bool)

            def hf_generate(prompt_ids, n_tokens):
                stamps.clear()
                with torch.inference_mode():
                    hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                                max_new_tokens=n_tokens, min_new_tokens=n_tokens, pad_token_id=0,
                                stopping_criteria=transformers.StoppingCriteriaList([Stamp()]))
                assert len(stamps) == n_tokens, f"{len(stamps)} stamps for {n_tokens} tokens"
                return stamps[-1] - stamps[0]

            hf_generate(ids[:, :32], 4)  # warm-up
            for _ in range(args.repeats):
                pause()
                gen_t.append(hf_generate(ids, steps + 1) / steps)  # steps + 1 tokens: `steps` decode forwards

            ours_s = min(ours_t) / steps
            loop_s, gen_s = min(loop_t) / steps, min(gen_t)
            hf_s = min(loop_s, gen_s)
            res[f"ours_decode_b{b}_tok_s"] = round(b / ours_s, 1)
            res[f"hf_decode_b{b}_tok_s"] = round(b / hf_s, 1)
            res[f"hf_decode_b{b}_tok_s_generate"] = round(b / gen_s, 1)
            res[f"hf_decode_b{b}_tok_s_loop"] = round(b / loop_s, 1)
            res[f"hf_decode_b{b}_method"] = "generate" if gen_s <= loop_s else "loop"
            res[f"ratio_decode_b{b}"] = round(hf_s / ours_s, 3)
            bar.update()

    finally:
        bar.close()
        if tmp is not None:
            tmp.cleanup()
    res["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    res["reference_hf_design_md"] = "prefill 2048 ~740 tok/s, decode b1 ~37 tok/s, b8 ~135 tok/s"
    write_json(res, args.json)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
