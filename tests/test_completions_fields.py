"""OpenAI completions fields through a real engine, as the official ``openai`` client meets them: logprobs and echo
(prompt log-probabilities against ``mj.LLM.score``'s log-softmax to 1e-4), ``n``, batch prompts, ``stop`` strings
and ids, ``seed``, ``stream_options.include_usage`` and cached tokens in the usage; the same fields and logprobs
through the gRPC front end."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mooncake_jax.gateway import GatewayServer
from mooncake_jax.instance.local_backend import EngineBackend
from mooncake_jax.proto import load

gateway_messages, gateway_services = load("gateway")

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(llm):
    backend = EngineBackend(llm, model_name="tiny", timeout_s=60)
    with GatewayServer(backend, grpc_port=0, model_name="tiny", tokenizer="bytes") as gw:
        yield gw, openai.OpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="none", max_retries=0)
    backend.close()


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_echo_prompt_logprobs_match_score(served, llm):
    _, c = served
    prompts = [[1, 40, 77, 200, 13, 9, 301], [1, 8, 8, 8, 450]]
    answer = c.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [ch.index for ch in answer.choices] == [0, 1]
    for prompt, choice in zip(prompts, answer.choices):
        scored = log_softmax(llm.score(prompt))
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt)
        expected = [scored[i, prompt[i + 1]] for i in range(len(prompt) - 1)]
        np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=1e-4)
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == 12


def test_generated_logprobs_match_score_and_echo_prepends_the_prompt(served, llm):
    _, c = served
    prompt = [1, 70, 71, 72, 73]
    answer = c.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=3, echo=True,
                                  extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    ids = choice.token_ids
    scored = log_softmax(llm.score(prompt + ids))
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(prompt) + 4
    for j, token in enumerate(ids):
        assert abs(lp.token_logprobs[len(prompt) + j] - scored[len(prompt) - 1 + j, token]) < 1e-4
        assert len(lp.top_logprobs[len(prompt) + j]) == 3
    assert lp.text_offset == sorted(lp.text_offset)


def test_n_seed_batch_and_usage(served):
    _, c = served
    answer = c.completions.create(model="tiny", prompt=[[1, 5, 6, 7], [1, 9, 9]], n=2, max_tokens=4,
                                  temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [ch.index for ch in answer.choices] == list(range(4))
    outs = [tuple(ch.token_ids) for ch in answer.choices]
    assert outs[0] != outs[1] and outs[2] != outs[3]  # n samples of one prompt differ (seeds seed + j)
    again = c.completions.create(model="tiny", prompt=[[1, 5, 6, 7], [1, 9, 9]], n=2, max_tokens=4,
                                 temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [tuple(ch.token_ids) for ch in again.choices] == outs  # reproducible from the seed
    assert answer.usage.prompt_tokens == 7 and answer.usage.completion_tokens == 16


def test_stop_ids_stop_strings_and_streamed_usage(served):
    _, c = served
    base = c.completions.create(model="tiny", prompt=[1, 33, 34], max_tokens=6, extra_body={"ignore_eos": True})
    ids = base.choices[0].token_ids
    stopped = c.completions.create(model="tiny", prompt=[1, 33, 34], max_tokens=6,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]]})
    assert stopped.choices[0].token_ids == ids[: ids.index(ids[2]) + 1]
    assert stopped.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="tiny", prompt=[1, 33, 34], max_tokens=6, n=2, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    per_choice = {0: [], 1: []}
    for ch in chunks[:-1]:
        for choice in ch.choices:
            per_choice[choice.index] += choice.token_ids or []
    assert per_choice[0] == per_choice[1] == ids  # greedy: both samples as the plain answer
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    text = "".join(chr(t) for t in ids if t < 256)  # the byte tokenizer: a stop string cuts the text before it
    if len(text) >= 3:
        cut = c.completions.create(model="tiny", prompt="!!", max_tokens=6, stop=[text[1:3]],
                                   extra_body={"ignore_eos": True})
        assert text[1:3] not in cut.choices[0].text


@pytest.mark.parametrize("field,value,message", [
    ("top_k", -3, "top_k"), ("min_p", 2.0, "min_p"), ("repetition_penalty", -1.0, "repetition_penalty"),
    ("frequency_penalty", 9.0, "frequency_penalty"), ("presence_penalty", 9.0, "presence_penalty"),
    ("logit_bias", {"100000": 1}, "logit_bias"), ("logprobs", 50, "logprobs"), ("n", 0, "n must be"),
    ("seed", -5, "seed")])
def test_bad_values_are_400_naming_the_field(served, field, value, message):
    _, c = served
    with pytest.raises(openai.BadRequestError, match=message):
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={field: value})


def test_sampling_fields_reach_the_engine(served, llm):
    """A logit bias of +100 on one token makes greedy pick it; top_k 1 with temperature is greedy."""
    _, c = served
    forced = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, logit_bias={"77": 100},
                                  extra_body={"ignore_eos": True})
    assert forced.choices[0].token_ids == [77, 77, 77]
    greedy = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True})
    top1 = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=1.5, seed=3,
                                extra_body={"ignore_eos": True, "top_k": 1, "min_p": 0.5,
                                            "repetition_penalty": 1.0})
    assert top1.choices[0].token_ids == greedy.choices[0].token_ids


def test_llm_text_api(llm, tmp_path):
    """``mj.LLM``: text in, text out, equal to the token-id path through the tokenizer; ``score`` of text; ``chat``
    renders the template and answers with the reply's text."""
    tok = llm.tokenizer
    ids = llm.generate([tok.encode("hello")], max_new_tokens=4, ignore_eos=True)[0]
    assert llm.generate("hello", max_new_tokens=4, ignore_eos=True) == tok.decode(ids)
    assert llm.generate(["hello", "hello"], max_new_tokens=4, ignore_eos=True) == [tok.decode(ids)] * 2
    np.testing.assert_array_equal(llm.score("hello"), llm.score(tok.encode("hello")))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    reply = llm.chat([{"role": "user", "content": "hi"}], max_new_tokens=3, chat_template=template)
    expected = llm.generate([tok.encode("[user]hi[assistant]")], max_new_tokens=3)[0]
    assert reply == tok.decode(expected)
    with pytest.raises(ValueError, match="unknown sampling option"):
        llm.generate([[1, 2]], top_kk=3)


def test_grpc_sampling_fields_and_logprobs(served, llm):
    """gRPC ``Generate``: prompt and generated logprobs match ``mj.LLM.score`` to 1e-4 (top alternatives best
    first), a logit bias forces its token, and a bad field is INVALID_ARGUMENT naming it."""
    gw, _ = served
    prompt = [1, 70, 71, 72, 73]
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        stub = gateway_services.GatewayStub(channel)

        def generate(**fields):
            replies = stub.Generate(gateway_messages.GenerateRequest(prompt_token_ids=prompt, ignore_eos=True,
                                                                     **fields), timeout=60)
            return [r.token for r in replies if r.WhichOneof("event") == "token"]

        tokens = generate(max_tokens=4, logprobs=2, prompt_logprobs=1)
        ids = [t.token_id for t in tokens]
        scored = log_softmax(llm.score(prompt + ids))
        first = tokens[0].prompt_logprobs
        np.testing.assert_allclose([e.logprob for e in first], [scored[i, prompt[i + 1]] for i in range(4)],
                                   atol=1e-4)
        assert all(len(e.top_ids) == 1 for e in first) and not tokens[1].prompt_logprobs
        for j, t in enumerate(tokens):
            row = scored[len(prompt) - 1 + j]
            assert abs(t.logprob.logprob - row[ids[j]]) < 1e-4
            assert list(t.logprob.top_ids) == list(np.argsort(-row)[:2])
            np.testing.assert_allclose(t.logprob.top_logprobs, np.sort(row)[::-1][:2], atol=1e-4)
        assert [t.token_id for t in generate(max_tokens=3, logit_bias={77: 100.0}, top_k=5, min_p=0.1,
                                             repetition_penalty=1.1)] == [77, 77, 77]
        with pytest.raises(grpc.RpcError) as err:
            generate(max_tokens=2, top_k=-3)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in err.value.details()
