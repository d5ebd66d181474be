"""What a newcomer's first mistakes are told: each error says what to do instead, and never suggests
something that cannot work (issue 25, "the first hour without a rough edge")."""

from __future__ import annotations

import inspect

import pytest

from asyncinfer import AsyncEngine, EngineClosedError, InvalidParameterError
from tests.helpers import ENGINE_BASE, greedy


async def test_a_closed_engine_says_to_load_a_new_one_not_to_start_it_again(tiny_models) -> None:
    """A closed engine never runs again: its errors said "use 'async with engine:' or 'await engine.start()'",
    which then raised "cannot be started again". They now say to load a new engine."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    with pytest.raises(EngineClosedError) as before:
        await engine.generate([5, 6], greedy(2))
    assert str(before.value) == "the engine is not started yet: use 'async with engine:' or 'await engine.start()'"
    async with engine:
        with pytest.raises(EngineClosedError) as again:
            await engine.start()
        assert str(again.value).startswith("the engine is already running")
        assert (await engine.generate([5, 6], greedy(2))).finish_reason == "length"
    with pytest.raises(EngineClosedError) as after:
        await engine.generate([5, 6], greedy(2))
    message = str(after.value)
    assert message.startswith("the engine is closed and cannot be started again: load a new engine")
    assert "AsyncEngine.load(" in message and "engine.start()" not in message
    with pytest.raises(EngineClosedError) as restart:
        async with engine:
            pass
    assert str(restart.value).startswith("the engine cannot be started again (state: closed): an engine runs once")
    assert "load a new engine" in str(restart.value)


@pytest.mark.parametrize("prompts", [["Hi", "Hello"], [[5, 6], [7, 8]], ([{"role": "user", "content": "Hi"}],)])
async def test_a_list_of_prompts_is_told_one_prompt_per_call_and_how_to_send_several(tiny_models, prompts) -> None:
    """A transformers pipeline takes a list of prompts; generate() takes one. The refusal says so, and how to
    send several at once (concurrent calls, which the engine batches)."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        for call in (engine.generate, engine.count_tokens):
            with pytest.raises(InvalidParameterError) as err:
                result = call(prompts)
                if inspect.iscoroutine(result):
                    await result
            assert err.value.parameter == "prompt"
            assert "one prompt per call" in err.value.allowed and "asyncio.gather" in err.value.allowed
        with pytest.raises(InvalidParameterError) as one:  # one malformed prompt gets no such advice
            await engine.generate({"role": "user", "content": "Hi"})
        assert "one prompt per call" not in str(one.value)
