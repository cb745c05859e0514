"""The engine: one model, one paged KV cache, and the narrow contract the instances drive.

- ``admit(seq)``: reuse the sequence's cached prefix pages, allocate pages for the rest of its prompt and reserve
  the pages its generation may need (so decode never runs out mid-way); ``OutOfPages`` if they do not fit now.
- ``prefill(seq)``: compute the prompt's KV beyond the cached prefix, in chunks of at most ``prefill_chunk_size``
  tokens, and sample the first token (optionally return the logits of every position).
- ``decode(seqs)``: one continuous-batching step: one new token for each of the given sequences, of any lengths.
- ``release(seq)``: give the sequence's pages back (shared prefix pages stay while others hold them).
- ``read_blocks`` / ``load_blocks``: move whole KV blocks out of and into the cache (the pool and the Messenger).

Everything on the device goes through the pure step functions of ``steps.py``; this class only does the
bookkeeping (pages, buckets, padding) in Python.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import jax
import jax.numpy as jnp
import numpy as np

from ..blocks import BlockKey, num_blocks
from .attention import SCRATCH_PAGE, PagedBatch, resolve_impl
from .config import ModelConfig
from .host_memory import keep_large_blocks_on_heap
from .kv_cache import write_slots
from ..engine.kv_manager import KVCacheManager
from .llama import Llama
from .map_budget import check_map_headroom
from .sampling import ANY, MAX_LOGIT_BIAS, SampleOut, SamplingInputs, prompt_logprobs, sample_out
from .sequence import FINISH_LENGTH, FINISH_STOP, SamplingParams, Sequence, validate_prompt
from ..sharding.layout import SingleDevice
from ..sharding.pipeline import LayerPages, PipelineRunner, StepInputs
from .layer_hooks import LayerHooks

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
_sample_rows = jax.jit(sample_out, static_argnames=("mode",))  # the first token of an every-position prefill
_prompt_rows = jax.jit(prompt_logprobs)
WARM_CONTEXT_PAGES = 64
"""Context pages a warm-up step attends over (``Engine._warm_context``): two of the prefill's 32-page context
chunks, four or more of decode's, so every loop over the context is entered."""
SAMPLING_MODES = (ANY,)  # the step programs' sampling: one program covers greedy, temperature and top-p rows


def bucket(n: int, cap: int, minimum: int = 1, factor: int = 2) -> int:
    """Smallest power of ``factor`` >= n (and >= minimum), but never above ``cap`` (``cap`` itself is a bucket)."""
    size = 1
    while size < max(n, minimum):
        size *= factor
    return min(size, cap)


def padded_page_counts(pages: int) -> list[int]:
    """Every count ``Engine.padded_pages`` pads 1 .. ``pages`` pages to (1, 2, 4 ...; none for 0): the block-move
    programs warm-up compiles."""
    return [1 << i for i in range(bucket(pages, 1 << 30).bit_length())] if pages > 0 else []


def buckets(cap: int, minimum: int = 1, factor: int = 2) -> list[int]:
    """Every bucket ``bucket`` can return for n in 1..cap."""
    out, n = [], 1
    while True:
        b = bucket(n, cap, minimum, factor)
        if not out or b != out[-1]:
            out.append(b)
        if b >= cap:
            return out
        n = b + 1


class Engine:
    """A model with a paged KV cache, prefix reuse, chunked prefill and batched decode."""

    def __init__(self, model: Llama, *, num_pages: int | None = None, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                 max_batch: int = 32, prefill_chunk_size: int = 512, prefix_caching: bool = True,
                 layout=None, kv_dtype=None, bucket_factor: int = 2, scan_layers: bool | None = None,
                 pack_inputs: bool | None = None):
        cfg: ModelConfig = model.cfg
        if prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if jax.default_backend() == "cpu":  # steps' temporaries reused, not mapped afresh (host_memory.py); one
            keep_large_blocks_on_heap()  # malloc arena for all threads is a prefill process's choice, made before JAX
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.max_batch = max_batch
        self.prefill_chunk_size = prefill_chunk_size
        if bucket_factor < 2:
            raise ValueError(f"bucket_factor must be >= 2, got {bucket_factor}")
        # Prefill chunk lengths are padded to powers of this factor (fewer programs to compile vs less padding);
        # batch sizes always to powers of two (their padding costs every step); context tables see
        # ``context_width``.
        self.bucket_factor = bucket_factor
        self.max_pages_per_seq = num_blocks(cfg.max_seq_len, cfg.block_size)
        if num_pages is None:
            per_page = cfg.kv_bytes_per_block(kv_dtype)
            num_pages = 1 + min(max(kv_cache_bytes // per_page, self.max_pages_per_seq),
                                max_batch * self.max_pages_per_seq)
        self.layout = layout or SingleDevice(cfg)
        # Layers under lax.scan (compile time flat in depth) or unrolled (faster on XLA:CPU); None: by backend.
        # A layout may bring its own runner (sharding.spmd: the whole pipeline as one SPMD program).
        build_runner = getattr(self.layout, "build_runner", None)
        # Whether ``auto`` runs the pallas kernels here (``context_width``); an SPMD pipeline's stages run xla.
        cache_shape = (cfg.head_dim, cfg.block_size, jnp.dtype(kv_dtype or cfg.param_dtype).itemsize)
        self._auto_is_pallas = build_runner is None and resolve_impl("auto", cache_shape) == "pallas"
        self.runner = (build_runner(model, num_pages, kv_dtype, scan_layers) if build_runner is not None
                       else PipelineRunner(model, self.layout, num_pages, kv_dtype, scan=scan_layers,
                                           pack_inputs=pack_inputs))
        # Page bookkeeping (admission, reservations, prefix reuse) lives in the engine layer's KV-cache manager.
        self.kv = KVCacheManager(num_pages, cfg.block_size, prefix_caching)
        self.allocator, self.prefix_cache = self.kv.allocator, self.kv.prefix_cache
        self._scratch_slot = SCRATCH_PAGE * cfg.block_size  # where padded tokens write their K/V

    # ---- pages (delegated to the KV-cache manager) -------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def kv_dtype(self) -> np.dtype:
        """The KV cache's dtype as everything outside the engine sees it (blocks read, written, pooled, sent): the
        logical float dtype, whatever the backend stores it as (``kv_scatter.storage_dtype``)."""
        return np.dtype(self.runner.kv[0][0].dtype)

    @property
    def free_pages(self) -> int:
        """Pages neither in use nor promised (cached-only pages count as used until evicted)."""
        return self.kv.free_pages

    @property
    def pages_in_use(self) -> int:
        """Pages held by sequences (beyond the prefix cache's own) or promised to them: 0 when nothing runs."""
        return self.kv.pages_in_use

    def new_sequence(self, prompt, params: SamplingParams | None = None) -> Sequence:
        """A validated sequence (ValueError naming the problem otherwise)."""
        params = params or SamplingParams()
        params.validate(self.cfg.vocab_size)
        tokens = validate_prompt(prompt, self.cfg, params.max_new_tokens)
        need = num_blocks(len(tokens) + params.max_new_tokens, self.block_size)
        if need > self.num_pages - 1:
            raise ValueError(f"request needs {need} KV pages but the cache has only {self.num_pages - 1}; "
                             f"shorten the prompt or max_new_tokens, or give the engine more pages")
        return Sequence(tokens, params)

    def prompt_keys(self, seq: Sequence) -> list[BlockKey]:
        return self.kv.prompt_keys(seq)

    def admit(self, seq: Sequence, cached_pages: SequenceABC[int] | None = None,
              cached_tokens: int | None = None) -> None:
        """Give ``seq`` pages for its prompt (reusing its cached prefix) and reserve its generation's pages; see
        ``KVCacheManager.admit``. Raises OutOfPages, with nothing held, when the cache cannot take it now. A sequence
        that wants its prompt's logprobs reuses no prefix (a cached position has no logits)."""
        if cached_pages is None and seq.params.prompt_logprobs is not None:
            cached_pages = []
        self.kv.admit(seq, cached_pages, cached_tokens)

    def adopt(self, seq: Sequence, pages: SequenceABC[int], first_token: int, first_logprob=None) -> None:
        """Take over a sequence prefilled elsewhere: ``pages`` hold its whole prompt's KV (loaded with
        ``load_blocks``) and ``first_token`` is the token the prefill sampled (``first_logprob``: its
        ``(logprob, top alternatives)`` when the request wants logprobs). Decode continues from there."""
        self.admit(seq, cached_pages=pages, cached_tokens=len(seq.prompt))
        if first_logprob is not None:
            seq.logprobs.append(first_logprob)
        self._append(seq, first_token)

    def release(self, seq: Sequence) -> None:
        """Return the sequence's pages and unused reservation; its full prompt blocks stay in the prefix cache."""
        self.kv.release(seq)

    # ---- compute -----------------------------------------------------------------------------------------
    def _sampling(self, seqs: SequenceABC[Sequence], rows: int):
        """Per-row sampling arrays of a step. Rows without penalties or bias leave their history and bias rows
        empty (padding), so the Python cost of a step grows only with the requests that use them."""
        p = [s.params for s in seqs] + [SamplingParams()] * (rows - len(seqs))
        steps = [len(s.output) for s in seqs] + [0] * (rows - len(seqs))
        vocab, width = self.cfg.vocab_size, self.cfg.max_seq_len
        history = np.full((rows, width if any(x.penalized for x in p) else 1), vocab, np.int32)
        output_start = np.zeros(rows, np.int32)
        bias_ids = np.full((rows, MAX_LOGIT_BIAS), vocab, np.int32)
        bias_values = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
        for r, s in enumerate(seqs):
            if s.params.penalized:
                n = len(s.prompt)
                history[r, :n] = s.prompt
                history[r, n: n + len(s.output)] = s.output
                output_start[r] = n
            for i, (token, bias) in enumerate(s.params.logit_bias):
                bias_ids[r, i], bias_values[r, i] = token, bias
        if history.shape[1] != width:  # one shape for every step: the padding row is broadcast on the device
            history = np.broadcast_to(history, (rows, width))
        inputs = SamplingInputs(
            np.array([x.temperature for x in p], np.float32), np.array([x.top_p for x in p], np.float32),
            np.array([x.seed for x in p], np.uint32), np.array(steps, np.int32),
            top_k=np.array([x.top_k for x in p], np.int32), min_p=np.array([x.min_p for x in p], np.float32),
            repetition_penalty=np.array([x.repetition_penalty for x in p], np.float32),
            frequency_penalty=np.array([x.frequency_penalty for x in p], np.float32),
            presence_penalty=np.array([x.presence_penalty for x in p], np.float32),
            history=history, output_start=output_start, bias_ids=bias_ids, bias_values=bias_values,
            want_logprobs=np.array([x.logprobs is not None for x in p], np.bool_))
        # One program per step shape covers every sampling setting (ANY picks the path at run time), so warm-up
        # compiles each shape once and a request that turns on any setting never waits for XLA.
        return inputs, ANY

    def context_width(self, pages: int) -> int:
        """Width of the context page table of a step whose longest context holds ``pages`` pages: 0 without any
        (a prefill's first chunk: the program without the context loop), else one width per implementation.

        The xla attention reads the context only up to the real ``ctx_len`` (``attention._context_loop`` for
        prefill, ``_decode_xla``'s loop for decode: chunks of pages, a ``while`` loop up to the longest context),
        so its table width is only a shape: every table is ``max_pages_per_seq`` wide and each (chunk, kind) or
        batch size is one program (warm-up compiles a few instead of one per power-of-two width; the wider table
        costs one host -> device copy of a few hundred KiB at most, measured in docs/benchmarks/engine.md, Xeon
        warm-up fourteenth pass). The pallas kernels' cost grows with the width (the GPU decode kernel splits the
        table into ``width // 8`` partitions and reduces over them; the TPU one steps a grid over it), so there the
        table stays a power of two >= the pages held."""
        if pages <= 0:
            return 0
        if self.cfg.attention == "pallas" or (self.cfg.attention == "auto" and self._auto_is_pallas):
            return bucket(pages, self.max_pages_per_seq)
        return self.max_pages_per_seq

    def context_widths(self) -> list[int]:
        """Every nonzero width ``context_width`` can return (ascending)."""
        return sorted({self.context_width(p) for p in buckets(self.max_pages_per_seq)})

    def _context_table(self, pages_per_row: list[list[int]], rows: int, width: int) -> np.ndarray:
        table = np.zeros((rows, width), np.int32)
        for r, pages in enumerate(pages_per_row):
            table[r, : len(pages)] = pages
        return table

    def _step(self, tokens, positions, table, ctx_len, slots, logits_index, seqs, rows, mode=None) -> StepInputs:
        sampling, needed = self._sampling(seqs, rows)
        mode = mode or needed  # warm-up forces each mode; otherwise the cheapest that covers the batch
        return StepInputs(tokens, positions, PagedBatch(table, ctx_len, slots), logits_index, sampling, mode)

    def prefill(self, seq: Sequence, all_logits: bool = False, sample: bool = True,
                hooks: LayerHooks | None = None) -> np.ndarray:
        """Compute the prompt's KV after its cached prefix and sample its first token.

        The prompt is cut into chunks of at most ``prefill_chunk_size`` tokens, which go through the pipeline stages
        in the CPP schedule. Returns the float32 logits of the last prompt token [V], or of every computed position
        [n, V] with ``all_logits`` (cached prefix positions are not recomputed, so they are not included; with
        ``all_logits`` the first token is the greedy one).

        ``hooks`` (``layer_hooks.LayerHooks``): run layer by layer and call them between layers: each layer's KV of
        the prefix pages (the full blocks before ``seq.num_computed``) comes from ``hooks.wait_for_layer_load``,
        and the KV of every page this prefill writes goes to ``hooks.save_layer``.
        """
        n, bs, chunk = len(seq.prompt), self.block_size, self.prefill_chunk_size
        start = seq.num_computed
        if start >= n:
            raise ValueError("prefill needs at least one prompt token beyond the cached prefix")
        if seq.params.prompt_logprobs is not None and start > 0:
            raise ValueError("prompt logprobs need the whole prompt computed: admit the sequence without a prefix")
        want_prompt = seq.params.prompt_logprobs is not None
        every_position = all_logits or want_prompt
        self.kv.grow(seq, n)
        steps, lengths = [], []
        while start < n:
            t = min(chunk, n - start)
            tb = bucket(t, chunk, 16, self.bucket_factor)
            ctx_pages = seq.pages[: num_blocks(start, bs)]
            pb = self.context_width(len(ctx_pages))
            tokens = np.zeros((1, tb), np.int32)
            tokens[0, :t] = seq.prompt[start: start + t]
            positions = np.arange(start, start + tb, dtype=np.int32)[None]
            slots = np.full((1, tb), self._scratch_slot, np.int32)
            slots[0, :t] = write_slots(seq.pages, start, t, bs)
            index = None if every_position else np.array([t - 1], np.int32)
            steps.append(self._step(tokens, positions, self._context_table([ctx_pages], 1, pb),
                                    np.array([start], np.int32), slots, index, [seq], 1))
            lengths.append(t)
            start += t
        pages = None
        if hooks is not None:
            first = seq.num_computed // bs  # the page the first chunk writes into
            pages = LayerPages(self.padded_pages(seq.pages[:first]) if first else None,
                               self.padded_pages(seq.pages[first: num_blocks(n, bs)]))
        outputs = self.runner.run(steps, hooks, pages)
        seq.num_computed = n
        if want_prompt:
            seq.prompt_logprobs = self._prompt_logprobs(seq, [out for _, out in outputs], lengths)
        if all_logits:
            logits = np.concatenate([np.asarray(out[0, :t]) for (_, out), t in zip(outputs, lengths)], axis=0)
        elif want_prompt:
            logits = np.asarray(outputs[-1][1][0, lengths[-1] - 1])
        else:
            logits = np.asarray(outputs[-1][1][0])
        if sample:
            sampled = outputs[-1][0]
            if sampled is None:  # logits of every position: sample the last one with the request's settings
                sampled = _sample_rows(outputs[-1][1][:, lengths[-1] - 1], steps[-1].sampling, mode=ANY)
            self._append_sampled(seq, jax.device_get(sampled) if seq.params.logprobs is not None
                                 else sampled._replace(tokens=np.asarray(sampled.tokens)), 0)
        self.kv.cache_prompt(seq)
        return logits

    def _prompt_logprobs(self, seq: Sequence, outputs, lengths: list[int]):
        """(logprob, top alternatives) of prompt tokens 1 .. n-1 from the logits of every chunk (on the device)."""
        k, prompt, start, parts = seq.params.prompt_logprobs, seq.prompt, 0, []
        for out, t in zip(outputs, lengths):
            targets = np.zeros(out.shape[1], np.int32)
            following = prompt[start + 1: start + t + 1]
            targets[: len(following)] = following
            parts.append([np.asarray(x)[: len(following)] for x in _prompt_rows(out[0], targets)])
            start += t
        chosen, ids, lps = (np.concatenate(column) for column in zip(*parts))
        return [(float(c), tuple(zip(ids[i, :k].tolist(), lps[i, :k].tolist()))) for i, c in enumerate(chosen)]

    def decode(self, seqs: SequenceABC[Sequence]) -> list[int]:
        """One token for each sequence (each must have been prefilled and not be finished)."""
        if not seqs:
            return []
        if len(seqs) > self.max_batch:
            raise ValueError(f"decode batch of {len(seqs)} exceeds max_batch {self.max_batch}")
        bs = self.block_size
        rows = bucket(len(seqs), self.max_batch)  # batch sizes stay powers of two: decode speed matters most
        tokens = np.zeros((rows, 1), np.int32)
        positions = np.zeros((rows, 1), np.int32)
        ctx_len = np.zeros(rows, np.int32)
        slots = np.full((rows, 1), self._scratch_slot, np.int32)
        ctx_pages = []
        for r, seq in enumerate(seqs):
            if seq.finished or not seq.output:
                raise ValueError(f"sequence {seq.seq_id} is {'finished' if seq.finished else 'not prefilled'}")
            pos = seq.num_tokens - 1  # the last sampled token's KV is not in the cache yet
            self.kv.grow(seq, pos + 1)
            tokens[r, 0], positions[r, 0], ctx_len[r] = seq.output[-1], pos, pos
            slots[r, 0] = write_slots(seq.pages, pos, 1, bs)[0]
            ctx_pages.append(seq.pages[: num_blocks(pos, bs)])
        width = self.context_width(max(1, max(len(p) for p in ctx_pages)))
        table = self._context_table(ctx_pages, rows, width)
        step = self._step(tokens, positions, table, ctx_len, slots, np.zeros(rows, np.int32), seqs, rows)
        ((sampled, _),) = self.runner.run([step])
        if any(seq.params.logprobs is not None for seq in seqs):
            sampled = jax.device_get(sampled)
        else:
            sampled = sampled._replace(tokens=np.asarray(sampled.tokens))
        out = np.asarray(sampled.tokens)[: len(seqs)].tolist()
        for r, seq in enumerate(seqs):
            seq.num_computed = seq.num_tokens
            self._append_sampled(seq, sampled, r)
        return out

    def _append_sampled(self, seq: Sequence, sampled: SampleOut, row: int) -> None:
        """Append row ``row`` of a step's sampled tokens to ``seq``, with its logprobs if it asked for them."""
        k = seq.params.logprobs
        if k is not None:
            top_ids, top_lps = np.asarray(sampled.top_ids[row, :k]), np.asarray(sampled.top_logprobs[row, :k])
            seq.logprobs.append((float(sampled.logprob[row]), tuple(zip(top_ids.tolist(), top_lps.tolist()))))
        self._append(seq, int(sampled.tokens[row]))

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output.append(token)
        params = seq.params
        eos = params.eos_token_id if params.eos_token_id is not None else self.cfg.eos_token_id
        if len(seq.output) >= params.max_new_tokens:
            seq.finish_reason = FINISH_LENGTH
        elif (not params.ignore_eos and eos is not None and token == eos) or token in params.stop_token_ids:
            seq.finish_reason = FINISH_STOP

    # ---- compiling ahead of traffic -----------------------------------------------------------------------------
    def warmup(self, prefill: bool = True, decode: bool = True, progress=None,
               modes: SequenceABC[str] = SAMPLING_MODES, blocks: bool = True, prompt_logprobs: bool = True) -> int:
        """Compile every step shape this engine can run, for every sampling setting a request can select (greedy,
        temperature, top-p: the steps' ``ANY`` sampling covers them all in one program), and with ``blocks`` every
        bucketed block move (``read_blocks`` / ``load_blocks`` of 1, 2, 4 ... pages: a decode instance loads each
        arriving request's KV with one, and compiling it then stalls the running batch), so no request waits for
        XLA. With ``prefill`` and ``prompt_logprobs``, also the prefill programs that keep the logits of every
        position, with the log-softmax over them and the sampling of the last: what a request asking for prompt
        log-probabilities (``echo`` with ``logprobs``, as evaluation harnesses score) and ``score`` run.

        Everything runs on the scratch page only (nothing allocated, no sequence touched). Returns the number of
        programs (step shapes x ``modes``, every-position prefill shapes and their log-softmax per chunk size and
        one last-row sampling, plus two per block-move size); ``progress(done, total)`` is called after each step
        program.
        """
        shapes = []  # (rows, tokens, context pages, logits of every position)
        chunks = buckets(self.prefill_chunk_size, 16, self.bucket_factor)
        if prefill:
            contexts = [0] + self.context_widths()
            shapes += [(1, t, p, False) for t in chunks for p in contexts]
        if decode:
            shapes += [(b, 1, w, False) for b in buckets(self.max_batch) for w in self.context_widths()]
        programs = [(shape, mode) for shape in shapes for mode in modes]
        if prefill and prompt_logprobs:  # a prompt-logprobs prefill reuses no prefix: its context is whole chunks
            whole = [p for p in contexts if p == 0 or p >= num_blocks(self.prefill_chunk_size, self.block_size)]
            programs += [((1, t, p, True), ANY) for t in chunks for p in whole]
        for i, ((rows, t, width, every), mode) in enumerate(programs):
            check_map_headroom()  # a clear error, not a crash inside LLVM, where the process runs out of mappings
            index = None if every else np.zeros(rows, np.int32) if t == 1 else np.array([t - 1], np.int32)
            step = self._step(np.zeros((rows, t), np.int32), np.tile(np.arange(t, dtype=np.int32), (rows, 1)),
                              *self._warm_context(rows, width),
                              np.full((rows, t), self._scratch_slot, np.int32), index, [], rows, mode=mode)
            sampled, logits = self.runner.run([step])[-1]
            if every and width == 0:  # the programs over every position's logits, once per chunk size
                jax.block_until_ready(_prompt_rows(logits[0], np.zeros(t, np.int32)))
                jax.block_until_ready(_sample_rows(logits[:, t - 1], step.sampling, mode=ANY))
                np.asarray(logits[0, t - 1])  # the last row, as ``prefill`` reads it (an indexing program)
            elif t > 1:
                np.asarray(logits[0])  # the last-token logits, as ``prefill`` reads them (an indexing program)
            jax.block_until_ready(logits)
            if progress is not None:
                progress(i + 1, len(programs))
        extra = len(chunks) + 1 if prefill and prompt_logprobs else 0  # _prompt_rows per chunk size, _sample_rows
        stacked = self._warm_stacked_prefills(prompt_logprobs) if prefill else 0
        moves = self._warm_block_moves() if blocks else 0
        return len(programs) + extra + stacked + moves

    def stacked_prefill_shapes(self, every_position: bool) -> list[tuple[int, int]]:
        """(chunk slots, context pages) of every multi-chunk prefill program a runner that runs a whole prefill as
        one program (``runner.chunk_slots``: ``sharding.spmd``) can be asked for; [] for a runner that runs each
        chunk as its own program (the single-chunk shapes cover it).

        A prefill of n > 1 chunks stacks them to ``chunk_slots(n)`` slots, each as wide as a full chunk, with the
        context table of its last chunk, which starts (n - 1) chunks after the cached prefix (whole blocks; none
        with ``every_position``, which prompt log-probabilities need). Every prompt length up to the context and
        every cached prefix is enumerated, so the set is exact, not a guess."""
        slots_of = getattr(self.runner, "chunk_slots", None)
        if slots_of is None:
            return []
        chunk, bs, limit = self.prefill_chunk_size, self.block_size, self.cfg.max_seq_len
        shapes = set()
        for n in range(2, num_blocks(limit, chunk) + 1):
            first_last_start = (n - 1) * chunk  # the last chunk's start with no cached prefix
            last_starts = [first_last_start] if every_position else range(first_last_start, limit, bs)
            for start in last_starts:
                shapes.add((slots_of(n), self.context_width(num_blocks(start, bs))))
        return sorted(shapes)

    def _warm_context(self, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(page table, context lengths) of a warm-up step: ``width`` scratch pages per row, the first
        ``WARM_CONTEXT_PAGES`` of them (or all) context. A zero context would leave the attention's loop over
        context chunks unentered, and XLA:CPU then prepares that loop's body on the first request to reach the
        shape: measured, the first decode step at each new batch shape took 6-25 ms more CPU, a token gap of every
        running stream (demo seventh pass). A few iterations of the loop enter it as well as all of them, and a
        table of ``max_pages_per_seq`` pages (``context_width``) read whole would cost the warm-up a step over the
        longest context per program (``small``: 32K positions)."""
        # One token short of whole pages: decode's loop reads whole chunks, then a tail of short ones
        # (``attention.DECODE_TAIL_PAGES``), and a context of whole chunks would leave the tail's loop unentered.
        ctx = max(1, min(width, WARM_CONTEXT_PAGES) * self.block_size - 1)
        return np.full((rows, width), SCRATCH_PAGE, np.int32), np.full(rows, ctx, np.int32)

    def _warm_stacked_prefills(self, prompt_logprobs: bool) -> int:
        """Compile the multi-chunk prefill programs of ``stacked_prefill_shapes`` (scratch page only; the request
        sampling path ``ANY``): with them, no prompt longer than one chunk waits for XLA."""
        width = buckets(self.prefill_chunk_size, 16, self.bucket_factor)[-1]  # the first chunk is always whole
        done = 0
        for every in (False, True) if prompt_logprobs else (False,):
            for n_slots, pages in self.stacked_prefill_shapes(every):
                check_map_headroom()
                index = None if every else np.array([width - 1], np.int32)
                step = self._step(np.zeros((1, width), np.int32), np.arange(width, dtype=np.int32)[None],
                                  *self._warm_context(1, pages),
                                  np.full((1, width), self._scratch_slot, np.int32), index, [], 1, mode=ANY)
                self.runner.run([step] * n_slots)
                done += 1
        return done

    def _warm_block_moves(self) -> int:
        """Compile the block moves for every padded page count a request can need (scratch page only)."""
        dtype = self.kv_dtype
        sizes = padded_page_counts(self.max_pages_per_seq)
        for n in sizes:
            pages = np.full(n, SCRATCH_PAGE, np.int32)
            self.runner.read_blocks(pages)
            self.runner.write_blocks(pages, np.zeros((n,) + self.cfg.block_shape(), dtype))
        self.runner.block_until_ready()
        return 2 * len(sizes)

    # ---- whole blocks in and out (pool, Messenger) -----------------------------------------------------------
    def padded_pages(self, pages: SequenceABC[int]) -> np.ndarray:
        """Page ids padded with the scratch page to a bucketed count, so block moves compile a few shapes only."""
        padded = np.full(bucket(len(pages), 1 << 30), SCRATCH_PAGE, np.int32)
        padded[: len(pages)] = pages
        return padded

    def read_blocks(self, pages: SequenceABC[int]) -> np.ndarray:
        """KV of ``pages`` as blocks [n, layers, 2, block_size, kv_heads, head_dim] on the host."""
        return self.runner.read_blocks(self.padded_pages(pages))[: len(pages)]

    def cached_pages(self, keys: SequenceABC[BlockKey]) -> list[int]:
        """Pages of the leading ``keys`` already in the prefix cache (no hit counting)."""
        return self.kv.cached_pages(keys)

    def load_blocks(self, keys: SequenceABC[BlockKey], blocks: np.ndarray,
                    protect: SequenceABC[int] = ()) -> list[int]:
        """Put whole blocks that arrived from elsewhere (pool, Messenger) into the prefix cache; returns the page
        of every key (keys already cached keep their page and their block is not written again).

        Making room may evict unused cached pages; the pages of ``keys`` already cached and the ``protect`` pages
        (say, the caller's other prefix pages) are held meanwhile, so a request never loses part of its own prefix
        to its own load. The returned pages are held by the prefix cache only: an ``admit`` or ``adopt`` that uses
        them takes its own reference.
        """
        if self.prefix_cache is None:
            raise ValueError("load_blocks needs prefix caching enabled")
        blocks = np.asarray(blocks)
        expected = (len(keys),) + self.cfg.block_shape()
        if blocks.shape != expected:
            raise ValueError(f"blocks have shape {blocks.shape}, expected {expected}")
        missing, fresh = self.kv.pages_for_load(keys, protect)
        if missing:
            padded = self.padded_pages(fresh)
            data = np.zeros((len(padded),) + blocks.shape[1:], blocks.dtype)  # padding rows land in scratch
            data[: len(fresh)] = blocks[missing]
            self.runner.write_blocks(padded, data)
            self.kv.commit_load([keys[i] for i in missing], fresh)
        return [self.prefix_cache.page_of(key) for key in keys]

    def block_until_ready(self) -> None:
        self.runner.block_until_ready()
