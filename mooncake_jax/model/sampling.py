"""Token sampling on device: greedy, temperature, top-k, min-p, top-p, penalties and logit bias, reproducible from a
seed, with the log-probabilities of the chosen token and its top alternatives.

Each sequence's random key is derived from (its seed, the index of the token being generated), never from a
shared stream, so a sequence samples the same tokens alone or in any batch, in any engine or instance.

Every setting is a per-row array, so one compiled program serves every mix of requests; each optional stage
(logprobs, bias, penalties, top-k, min-p, top-p) runs under a ``lax.cond`` on whether any row of the batch uses
it, so a batch that uses none pays nothing for it. The order follows vLLM's sampler: log-probabilities of the raw
logits (what ``mj.LLM.score`` gives, log-softmaxed), then logit bias, then repetition / frequency / presence
penalties (greedy rows take the argmax of these processed logits), then temperature, top-k, min-p and top-p.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GREEDY, SAMPLE, TOP_P, ANY = "greedy", "sample", "top_p", "any"
"""Static sampling modes of a batch. ``batch_mode`` names the cheapest that covers every sequence in it; ``ANY``
covers every setting in one program and picks the cheapest path at run time (``lax.cond`` on the batch's own
settings), so an engine compiles one program per step shape, not one per mode, and still never waits for XLA
when a request selects another setting."""

MAX_LOGPROBS = 20
"""Top alternatives returned per token (OpenAI's and vLLM's limit); the top-k of the step is always this wide."""
MAX_LOGIT_BIAS = 64
"""Biased token ids one request may give (the bias arrays are this wide in every step)."""


class SamplingInputs(NamedTuple):
    """Per-row sampling settings. The fields after ``step`` may be None (that stage is then absent from the
    program); the engine always gives them all, so its one program covers every setting."""

    temperature: jax.Array  # [B] float32; 0 means greedy for that row
    top_p: jax.Array  # [B] float32 in (0, 1]
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32, index of the token being generated
    top_k: jax.Array | None = None  # [B] int32; 0: off
    min_p: jax.Array | None = None  # [B] float32 in [0, 1]; 0: off
    repetition_penalty: jax.Array | None = None  # [B] float32 > 0; 1: off (prompt and output tokens)
    frequency_penalty: jax.Array | None = None  # [B] float32; 0: off (output tokens, times their count)
    presence_penalty: jax.Array | None = None  # [B] float32; 0: off (output tokens, once)
    history: jax.Array | None = None  # [B, H] int32: prompt then output tokens, padded with V (ignored)
    output_start: jax.Array | None = None  # [B] int32: where the output begins in ``history``
    bias_ids: jax.Array | None = None  # [B, MAX_LOGIT_BIAS] int32, padded with V (ignored)
    bias_values: jax.Array | None = None  # [B, MAX_LOGIT_BIAS] float32
    want_logprobs: jax.Array | None = None  # [B] bool: compute the logprobs of this row


class SampleOut(NamedTuple):
    """What a step hands back: the tokens, and (zeros where no row asked) their float32 log-probabilities under the
    raw model and the ``MAX_LOGPROBS`` most likely tokens with theirs."""

    tokens: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32
    top_ids: jax.Array  # [B, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [B, MAX_LOGPROBS] float32


def batch_mode(temperatures, top_ps) -> str:
    if all(t == 0 for t in temperatures):
        return GREEDY
    return TOP_P if any(p < 1.0 for t, p in zip(temperatures, top_ps) if t > 0) else SAMPLE


def _row_keys(seed, step):
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, step)


def _threshold_bits(probs: jax.Array, enough) -> jax.Array:
    """Per row, the largest probability bit pattern t with ``enough(p >= t)`` still true, by bisection over the
    bit patterns of the float32 probabilities (monotone for non-negative floats; 31 halvings pin it exactly):
    31 masked reductions over the vocabulary instead of a sort, which cost more than the whole decode step at
    batch 32 on a 2-core CPU (0.3 s for a [32, 32000] sort)."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # >= 0, ordered like probs

    def halve(_, bounds):
        lo, hi = bounds  # enough holds at lo; at hi it does not (or hi is past every probability)
        mid = lo + (hi - lo) // 2
        ok = enough(bits >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    b = probs.shape[0]
    lo = jnp.zeros((b,), jnp.int32)
    hi = jnp.full((b,), 0x7F800001, jnp.int32)  # just past +inf
    lo, _ = jax.lax.fori_loop(0, 31, halve, (lo, hi))
    return bits >= lo[:, None]


def _top_p_mask(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """Scaled logits with every token outside the smallest set of mass >= top_p set to -inf.

    The set is {p >= t} for the largest probability t whose {p >= t} still holds mass >= top_p (ties at t are
    kept)."""
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = _threshold_bits(probs, lambda inside: jnp.sum(jnp.where(inside, probs, 0.0), axis=-1) >= top_p)
    keep = keep | (top_p[:, None] >= 1.0)  # rounding must not drop a top_p = 1 row's tail
    return jnp.where(keep, scaled, -jnp.inf)


def _top_k_mask(scaled: jax.Array, top_k: jax.Array) -> jax.Array:
    """Scaled logits outside each row's ``top_k`` most likely tokens set to -inf (ties at the k-th are kept; 0 or
    k >= V: no mask)."""
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = _threshold_bits(probs, lambda inside: jnp.sum(inside, axis=-1) >= top_k)
    keep = keep | (top_k[:, None] <= 0)
    return jnp.where(keep, scaled, -jnp.inf)


def _min_p_mask(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Tokens whose probability is below ``min_p`` times the row's largest set to -inf."""
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, scaled, -jnp.inf)


def _with_bias(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, inputs.bias_ids].add(inputs.bias_values, mode="drop")


def _with_penalties(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """vLLM's penalties: repetition divides a positive logit (multiplies a negative one) of every token seen in the
    prompt or output; frequency subtracts per output occurrence, presence once per token in the output."""
    b, v = logits.shape
    hist = inputs.history
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], hist.shape)
    in_output = (jnp.arange(hist.shape[1])[None, :] >= inputs.output_start[:, None]).astype(jnp.float32)
    counts = jnp.zeros((b, v), jnp.float32).at[rows, hist].add(in_output, mode="drop")
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, hist].set(True, mode="drop")
    rep = inputs.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - inputs.frequency_penalty[:, None] * counts
            - inputs.presence_penalty[:, None] * (counts > 0).astype(jnp.float32))


def _when(flag, fn, x):
    return jax.lax.cond(flag, fn, lambda y: y, x)


def processed_logits(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """The logits after bias and penalties: greedy rows take their argmax."""
    logits = logits.astype(jnp.float32)
    if inputs.bias_ids is not None:
        logits = _when(jnp.any(inputs.bias_ids < logits.shape[1]), lambda x: _with_bias(x, inputs), logits)
    if inputs.history is not None:
        active = ((inputs.repetition_penalty != 1.0) | (inputs.frequency_penalty != 0.0)
                  | (inputs.presence_penalty != 0.0))
        logits = _when(jnp.any(active), lambda x: _with_penalties(x, inputs), logits)
    return logits


def sampling_logits(logits: jax.Array, inputs: SamplingInputs, top_p: bool = True) -> jax.Array:
    """The logits a sampled row draws from: processed, scaled by temperature, with top-k, min-p and top-p applied
    (masked tokens -inf); their softmax is the sampling distribution."""
    temp = jnp.where(inputs.temperature > 0, inputs.temperature, 1.0)
    scaled = processed_logits(logits, inputs) / temp[:, None]
    sampled = inputs.temperature > 0
    if inputs.top_k is not None:
        scaled = _when(jnp.any(sampled & (inputs.top_k > 0)), lambda x: _top_k_mask(x, inputs.top_k), scaled)
    if inputs.min_p is not None:
        scaled = _when(jnp.any(sampled & (inputs.min_p > 0)), lambda x: _min_p_mask(x, inputs.min_p), scaled)
    if top_p:
        scaled = _when(jnp.any(sampled & (inputs.top_p < 1.0)), lambda x: _top_p_mask(x, inputs.top_p), scaled)
    return scaled


def sample(logits: jax.Array, inputs: SamplingInputs, mode: str) -> jax.Array:
    """Next token [B] int32 from float32 logits [B, V]."""
    processed = processed_logits(logits, inputs)
    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if mode == GREEDY:
        return greedy
    if mode == ANY:
        return jax.lax.cond(jnp.any(inputs.temperature > 0), lambda: _draw(logits, inputs, greedy, True),
                            lambda: greedy)
    return _draw(logits, inputs, greedy, mode == TOP_P)


def sample_out(logits: jax.Array, inputs: SamplingInputs, mode: str) -> SampleOut:
    """``sample`` with the log-probabilities of the chosen tokens and the top ``MAX_LOGPROBS`` alternatives under
    the raw model (float32 log-softmax), computed only when a row has ``want_logprobs``."""
    tokens = sample(logits, inputs, mode)
    b = logits.shape[0]
    k = min(MAX_LOGPROBS, logits.shape[1])

    def compute():
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top_lp, top_ids = jax.lax.top_k(logprobs, k)
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def skip():
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

    if inputs.want_logprobs is None:
        return SampleOut(tokens, *skip())
    return SampleOut(tokens, *jax.lax.cond(jnp.any(inputs.want_logprobs), compute, skip))


def prompt_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For logits [T, V] of consecutive positions and the token that follows each [T]: (logprob of that token [T],
    top ``MAX_LOGPROBS`` ids [T, k], their logprobs [T, k]), float32 log-softmax on the device."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
    return chosen, top_ids.astype(jnp.int32), top_lp


def _draw(logits: jax.Array, inputs: SamplingInputs, greedy: jax.Array, top_p: bool) -> jax.Array:
    scaled = sampling_logits(logits, inputs, top_p)
    keys = _row_keys(inputs.seed, inputs.step)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(inputs.temperature > 0, drawn, greedy)
