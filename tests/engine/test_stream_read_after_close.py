"""A stream made while the engine ran and first read after it closed: the error says that a stream sends its request
at its first read (it said "the engine is closed and cannot be started again", though nothing was being started)."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, EngineClosedError
from tests.helpers import ENGINE_BASE, greedy


async def test_a_stream_first_read_after_close_says_why(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        late = engine.stream([5, 6, 7], greedy(4))
        read = engine.stream([5, 6, 7], greedy(4))
        assert [d async for d in read][-1].finish_reason == "length"  # read inside: served
    with pytest.raises(EngineClosedError) as caught:
        await anext(late)
    assert str(caught.value) == ("the engine was closed at this stream's first read: a stream sends its request "
                                 "when it is first read, so read it before the engine closes (inside 'async with "
                                 "engine:')")
    with pytest.raises(EngineClosedError, match="cannot be started again"):  # a new call after close: as before
        engine.stream([5, 6, 7], greedy(4))
