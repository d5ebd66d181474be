"""stranger60: a request given no ``SamplingParams`` on an engine of a short ``max_model_len`` was refused for
``max_tokens=128``, the default the caller never chose (a ``MaxTokensOverContextError`` naming a value nobody
passed), and that refusal hid the prompt's own fault (a bad chat role). With no params the defaults are cut where
the context ends, as the HTTP server's default is; a limit the caller did set is still refused."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, MaxTokensOverContextError, SamplingParams

OPTIONS = {"max_model_len": 64, "device": "cpu", "num_threads": 1}


@pytest.fixture
async def engine(real_gguf):
    async with await AsyncEngine.load(real_gguf, **OPTIONS) as engine:
        yield engine


async def test_no_params_runs_to_the_context_not_refused_for_the_default(engine) -> None:
    prompt = "Count from one to one hundred, in words, one number a line."
    prompt_tokens = engine.count_tokens(prompt)
    out = await engine.generate(prompt)
    assert out.finish_reason in ("stop", "length")
    assert len(out.token_ids) <= 64 - prompt_tokens
    engine.check_request(prompt)  # what generate() runs, checked alone: no refusal either
    deltas = [d async for d in engine.stream(prompt)]
    assert deltas[-1].finish_reason in ("stop", "length")
    with pytest.raises(MaxTokensOverContextError) as err:  # a limit the caller set is still theirs to lower
        await engine.generate(prompt, SamplingParams(max_tokens=128))
    assert err.value.value == 128
    assert engine.num_unfinished_requests == 0


async def test_no_params_lets_the_prompt_s_own_fault_be_named(engine) -> None:
    with pytest.raises(InvalidParameterError) as err:
        await engine.generate([{"role": "bot", "content": "hi"}])
    assert err.value.parameter == "prompt[0].role"
