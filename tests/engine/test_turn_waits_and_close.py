"""A request waiting its turn (a long stop list, intake.Turns) when the engine closes fails at once with the plain
EngineClosedError, not when its turn would have come; and a stream read while the engine ran, which the engine closed
while the request was being bound, is not told it was read after close (pass38: 9a9e258's message said so of every
stream whose binding ended in EngineClosedError)."""

from __future__ import annotations

import asyncio
import time

import pytest

import asyncinfer.intake
from asyncinfer import AsyncEngine, EngineClosedError, SamplingParams
from asyncinfer.intake import TURN_CHECK_S
from tests.helpers import ENGINE_BASE, CharTokenizer, long_stops


async def test_a_stream_waiting_its_turn_when_the_engine_closes_fails_at_once_and_plainly(tiny_models,
                                                                                        monkeypatch) -> None:
    monkeypatch.setattr(asyncinfer.intake, "STOP_BUILD_CHARS_PER_S", 1.0)  # past the bucket, a long list waits hours
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    engine.core.tokenizer = CharTokenizer()

    async def read(variant: int) -> None:
        async for _ in engine.stream([5, 6, 7], SamplingParams(max_tokens=2, stop=long_stops(variant))):
            pass

    async with engine:
        await read(0)
        await read(1)  # the bucket's two
        waiting = asyncio.create_task(read(2))  # read in time, then waiting its turn
        await asyncio.sleep(0.1)
        assert not waiting.done()
    closed = time.monotonic()
    with pytest.raises(EngineClosedError) as caught:
        await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - closed < TURN_CHECK_S + 1.0  # not when its turn (hours away) came
    assert "first read" not in str(caught.value) and "the engine is clos" in str(caught.value), str(caught.value)
