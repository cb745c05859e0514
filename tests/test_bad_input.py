"""Every bad input raises ValueError saying what is wrong and what is allowed."""

import pytest

import mooncake_jax as mj


@pytest.fixture(scope="module")
def llm():
    return mj.LLM("tiny")


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([[]], {}, "prompt 0: prompt is empty"),
    ([[1, 2], [3, 512]], {}, "prompt 1: token id 512 at position 1 is outside the vocabulary \\[0, 512\\)"),
    ([[1, -1]], {}, "token id -1 at position 1"),
    ([[1] * 4000], {"max_new_tokens": 200}, "= 4200 exceeds the model's context of 4096"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ([[1]], {"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
    ([[1]], {"temperature": -1.0}, "temperature must be >= 0"),
    ([[1]], {"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ([[1]], {"eos_token_id": 9999}, "eos_token_id 9999 is outside"),
    ([1, 2, 3], {}, "wrap a single prompt"),
    (b"hello", {}, "list of token-id lists"),  # bytes: neither text (now accepted) nor token ids
    ([[1.5, 2.0]], {}, "integer token ids"),
])
def test_generate_rejects(llm, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, **kwargs)


def test_score_rejects_bad_tokens(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.score([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.score([1, 600])


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "gpt-17"}, "unknown model 'gpt-17': not a preset \\(tiny, small"),
    ({"dtype": "float16"}, "unknown dtype 'float16'; allowed: \\['bfloat16', 'float32'\\]"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"prefill_chunk_size": 0}, "prefill_chunk_size must be a positive integer"),
    ({"tensor_parallel": 0}, "tensor_parallel must be a positive integer"),
])
def test_constructor_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mj.LLM(**{"model": "tiny", **kwargs})


def test_a_good_request_still_works_after_bad_ones(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [999]])
    assert len(llm.generate([[1, 2]], max_new_tokens=3)[0]) == 3
