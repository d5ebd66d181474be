"""A call on an engine that is not started, under trio, names asyncio and the guide.

It said "the engine is not started yet: use 'async with engine:'", which under trio only leads to
``start()``'s refusal one step later."""

from __future__ import annotations

import asyncio

import pytest
import trio

from asyncinfer import AsyncEngine, EngineClosedError, SamplingParams, WrongEventLoopError
from tests.helpers import ENGINE_BASE

GUIDE = ("the engine runs on asyncio only, and no asyncio event loop runs here (trio, or anyio's trio backend?): run "
         "it on an asyncio loop in a thread of its own (docs/guides/trio.md)")


@pytest.mark.parametrize("call", ["generate", "stream", "embed"])
def test_a_call_under_trio_on_an_engine_not_started_names_the_guide(tiny_models, call: str) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)

    async def main() -> None:
        if call == "generate":
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
        elif call == "stream":
            async for _ in engine.stream([1, 2, 3], SamplingParams(max_tokens=2)):
                pass
        else:
            await engine.embed("a text")

    with pytest.raises(WrongEventLoopError) as caught:
        trio.run(main)
    assert str(caught.value) == GUIDE


def test_on_asyncio_the_same_call_still_says_start_it(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)

    async def main() -> None:
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))

    with pytest.raises(EngineClosedError) as caught:
        asyncio.run(main())
    assert type(caught.value) is EngineClosedError
    assert str(caught.value) == "the engine is not started yet: use 'async with engine:' or 'await engine.start()'"
