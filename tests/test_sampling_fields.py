"""top-k, min-p, penalties, logit bias and logprobs of the one sampling program, against a hand-written float64 numpy
sampler (sorts and loops, nothing shared with the device code) and against ``mj.LLM.score``."""

import jax
import numpy as np
import pytest

from mooncake_jax.model.sampling import ANY, MAX_LOGIT_BIAS, SamplingInputs, sample_out, sampling_logits

V = 64


def numpy_distribution(logits, *, temp=1.0, top_k=0, min_p=0.0, top_p=1.0, rep=1.0, freq=0.0, pres=0.0,
                       prompt=(), output=(), bias=()):
    """The sampling distribution as vLLM's sampler defines it, step by step in float64."""
    x = np.array(logits, np.float64)
    for token, b in bias:
        x[token] += b
    counts = np.zeros(len(x))
    for t in output:
        counts[t] += 1
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    x = x - freq * counts - pres * (counts > 0)
    x = x / temp

    def softmax(y):
        e = np.exp(y - y[np.isfinite(y)].max())
        return e / e.sum()

    if 0 < top_k < len(x):
        p = softmax(x)
        kth = np.sort(p)[::-1][top_k - 1]
        x[p < kth] = -np.inf
    if min_p:
        p = softmax(x)
        x[p < min_p * p.max()] = -np.inf
    if top_p < 1:
        p = softmax(x)
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        last = order[before < top_p][-1]
        x[p < p[last]] = -np.inf
    return softmax(x)


def inputs_for(rows):
    """SamplingInputs of rows given as dicts of numpy_distribution's keywords."""
    b, width = len(rows), 32
    hist = np.full((b, width), V, np.int32)
    start = np.zeros(b, np.int32)
    bias_ids = np.full((b, MAX_LOGIT_BIAS), V, np.int32)
    bias_values = np.zeros((b, MAX_LOGIT_BIAS), np.float32)
    for r, row in enumerate(rows):
        prompt, output = list(row.get("prompt", ())), list(row.get("output", ()))
        hist[r, : len(prompt) + len(output)] = prompt + output
        start[r] = len(prompt)
        for i, (t, v) in enumerate(row.get("bias", ())):
            bias_ids[r, i], bias_values[r, i] = t, v
    f = lambda key, default: np.array([row.get(key, default) for row in rows], np.float32)  # noqa: E731
    return SamplingInputs(f("temp", 0.0), f("top_p", 1.0), np.arange(b, dtype=np.uint32), np.zeros(b, np.int32),
                          top_k=np.array([row.get("top_k", 0) for row in rows], np.int32), min_p=f("min_p", 0.0),
                          repetition_penalty=f("rep", 1.0), frequency_penalty=f("freq", 0.0),
                          presence_penalty=f("pres", 0.0), history=hist, output_start=start, bias_ids=bias_ids,
                          bias_values=bias_values, want_logprobs=np.ones(b, bool))


ROWS = [
    dict(temp=0.8, top_k=5),
    dict(temp=1.3, min_p=0.2),
    dict(temp=1.0, rep=1.7, prompt=[1, 2, 3, 9, 40], output=[7, 7, 50]),
    dict(temp=0.7, freq=0.9, pres=0.6, prompt=[4, 5], output=[5, 6, 6, 6, 11]),
    dict(temp=1.1, bias=[(3, 5.0), (10, -100.0), (20, 2.5)]),
    dict(temp=0.9, top_k=12, min_p=0.05, top_p=0.8, rep=1.3, freq=0.4, prompt=[0, 1, 2], output=[2, 3, 3]),
    dict(temp=1.0, top_k=1),  # top_k = 1: the argmax only
    dict(temp=1.0, top_k=V + 10),  # k past the vocabulary: no mask
]


def test_sampling_distribution_matches_numpy_reference():
    logits = (np.random.default_rng(3).standard_normal((len(ROWS), V)) * 2).astype(np.float32)
    logits[5, 30:34] = logits[5].max()  # a tie at the top
    got = np.asarray(jax.nn.softmax(jax.jit(sampling_logits)(logits, inputs_for(ROWS)), axis=-1))
    for r, row in enumerate(ROWS):
        kwargs = {k: v for k, v in row.items()}
        expected = numpy_distribution(logits[r], **kwargs)
        np.testing.assert_allclose(got[r], expected, atol=2e-6, err_msg=str(row))
        masked = expected == 0  # -inf in the reference: the device must mask exactly these (not just round low)
        assert (got[r][masked] == 0).all() and (got[r][expected > 1e-30] > 0).all(), row


def test_draws_stay_in_the_support_and_greedy_follows_penalties():
    logits = (np.random.default_rng(4).standard_normal((len(ROWS), V)) * 2).astype(np.float32)
    support = [numpy_distribution(logits[r], **row) > 0 for r, row in enumerate(ROWS)]
    step = jax.jit(sample_out, static_argnames="mode")
    for n in range(20):
        inputs = inputs_for(ROWS)._replace(step=np.full(len(ROWS), n, np.int32))
        tokens = np.asarray(step(logits, inputs, mode=ANY).tokens)
        assert all(support[r][t] for r, t in enumerate(tokens))
    # greedy rows take the argmax of the biased, penalized logits
    greedy = [dict(row, temp=0.0) for row in ROWS]
    tokens = np.asarray(step(logits, inputs_for(greedy), mode=ANY).tokens)
    for r, row in enumerate(greedy):
        ref = numpy_distribution(logits[r], **dict(row, temp=1.0, top_k=0, min_p=0.0, top_p=1.0))
        assert tokens[r] == int(np.argmax(ref)), row


def test_logprobs_are_the_raw_log_softmax():
    logits = (np.random.default_rng(5).standard_normal((len(ROWS), V)) * 3).astype(np.float32)
    out = jax.jit(sample_out, static_argnames="mode")(logits, inputs_for(ROWS), mode=ANY)
    x = logits.astype(np.float64)
    lsm = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprob), lsm[np.arange(len(ROWS)), tokens], atol=1e-5)
    order = np.argsort(-lsm, axis=1)[:, : out.top_ids.shape[1]]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(lsm, order, 1), atol=1e-5)


# ---- through the engine ---------------------------------------------------------------------------------------------
def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_engine_logprobs_match_score(llm):
    from mooncake_jax.model.sequence import SamplingParams

    prompt = [1, 17, 33, 5, 90, 41, 7, 300, 12]
    engine = llm.engine
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=5, logprobs=3, prompt_logprobs=2))
    llm._run([seq])
    scored = _log_softmax(llm.score(prompt + seq.output))
    for i, (lp, top) in enumerate(seq.prompt_logprobs):  # prompt token i + 1, predicted at position i
        assert abs(lp - scored[i, prompt[i + 1]]) < 1e-4
        assert [t for t, _ in top] == list(np.argsort(-scored[i])[:2])
    assert len(seq.prompt_logprobs) == len(prompt) - 1
    assert len(seq.logprobs) == len(seq.output) == 5
    for j, (lp, top) in enumerate(seq.logprobs):
        row = scored[len(prompt) - 1 + j]
        assert abs(lp - row[seq.output[j]]) < 1e-4
        assert len(top) == 3 and abs(top[0][1] - row.max()) < 1e-4


def test_engine_penalties_change_greedy_as_the_reference_says(llm, ref):
    """Greedy decoding with a strong repetition penalty and a logit bias, stepped against the float64 reference."""
    from mooncake_jax.model.sequence import SamplingParams
    from reference_model import random_prompts

    prompt = random_prompts([10], seed=21)[0]
    params = SamplingParams(max_new_tokens=6, repetition_penalty=3.0, presence_penalty=1.5,
                            logit_bias=((prompt[0], 4.0),))
    out = llm.engine.new_sequence(prompt, params)
    llm._run([out])
    tokens = list(prompt)
    for j in range(6):
        logits = ref(tokens)[-1]
        expected = int(np.argmax(np.log(numpy_distribution(
            logits, rep=3.0, pres=1.5, prompt=prompt, output=tokens[len(prompt):], bias=[(prompt[0], 4.0)]))))
        assert out.output[j] == expected, j
        tokens.append(expected)


@pytest.mark.parametrize("field,value", [("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0.0),
                                         ("frequency_penalty", 3.0), ("presence_penalty", -2.5),
                                         ("logprobs", 21), ("logit_bias", ((10**6, 1.0),))])
def test_bad_sampling_values_are_named(llm, field, value):
    from mooncake_jax.model.sequence import SamplingParams

    with pytest.raises(ValueError, match=field):
        llm.engine.new_sequence([1, 2, 3], SamplingParams(**{field: value}))
