"""Prompt + max_tokens over max_model_len: refused by name and numbers (vLLM's rule), or capped on request."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

OPTIONS = {"kv_cache_memory": 1 << 20, "max_model_len": 64, "dtype": "float32", "device": "cpu"}


@pytest.fixture
async def engine(tiny_models):
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS) as engine:
        yield engine


async def test_over_the_limit_is_refused_before_anything_is_queued(engine, tiny_models, hf_greedy) -> None:
    prompt = list(range(5, 55))  # 50 tokens: room for 14
    with pytest.raises(InvalidParameterError) as err:
        await engine.generate(prompt, SamplingParams(max_tokens=15, ignore_eos=True))
    assert err.value.parameter == "max_tokens" and err.value.value == 15
    assert err.value.allowed.startswith("at most max_model_len - prompt tokens = 64 - 50 = 14")
    with pytest.raises(InvalidParameterError, match="max_tokens=15"):
        engine.stream(prompt, SamplingParams(max_tokens=15))  # at the call, before any delta
    assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0
    exact = await engine.generate(prompt, SamplingParams(max_tokens=14, ignore_eos=True))  # exactly full
    assert exact.token_ids == hf_greedy(tiny_models["llama"][1], prompt, 14) and exact.finish_reason == "length"


async def test_opting_in_caps_the_output_at_max_model_len(engine, tiny_models, hf_greedy) -> None:
    prompt = list(range(5, 55))
    params = SamplingParams(max_tokens=1000, ignore_eos=True, truncate_output_to_model_len=True)
    out = await engine.generate(prompt, params)
    assert out.token_ids == hf_greedy(tiny_models["llama"][1], prompt, 14)  # 64 - 50 tokens, then "length"
    assert out.finish_reason == "length"
    with pytest.raises(InvalidParameterError, match="max_model_len - 1 = 63"):  # a prompt with no room at all
        await engine.generate(list(range(5, 69)), params)


def test_the_option_is_a_bool() -> None:
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(truncate_output_to_model_len="yes")
    assert err.value.parameter == "truncate_output_to_model_len"
