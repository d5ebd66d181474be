"""A flood of requests each with a long stop list of its own (pass37): the engine thread builds each request's stop
automaton (~12 ms for a list at both limits), so the flood held every neighbour's tokens for as long as its automata
took. Long lists now reach the engine at a bounded rate (intake.STOP_BUILD_CHARS_PER_S, a token bucket of two lists
at the limits): the flood waits its turn, short lists never wait, and a waiter that gives up frees its turn."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import asyncinfer.detokenizer
import asyncinfer.intake
from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.intake import STOP_BUILD_FREE_CHARS, Turns
from asyncinfer.sampling_params import MAX_STOP_CHARS
from tests.helpers import ENGINE_BASE, CharTokenizer, long_stops

RATE = 16 * MAX_STOP_CHARS  # chars a second here: a list at the limits every 1/16 s after the burst of two





@pytest.fixture
def builds(monkeypatch) -> list[tuple[float, int]]:
    """When each stop automaton was built on the engine thread, and of how many characters."""
    seen: list[tuple[float, int]] = []
    real = asyncinfer.detokenizer.StopMatcher.__init__

    def init(self, strings):
        real(self, strings)
        if threading.current_thread().name == "asyncinfer-core":
            seen.append((time.monotonic(), sum(map(len, strings))))

    monkeypatch.setattr(asyncinfer.detokenizer.StopMatcher, "__init__", init)
    monkeypatch.setattr(asyncinfer.intake, "STOP_BUILD_CHARS_PER_S", RATE)
    return seen


async def test_long_stop_lists_reach_the_engine_at_a_bounded_rate(tiny_models, builds) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    engine.core.tokenizer = CharTokenizer()
    async with engine:
        start = time.monotonic()
        flood = [asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=long_stops(i))))
                 for i in range(8)]
        await asyncio.sleep(0.01)
        short = await engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=["x" * STOP_BUILD_FREE_CHARS]))
        short_done = time.monotonic() - start
        await asyncio.gather(*flood)
    assert short.outputs[0].finish_reason == "length"
    long_builds = [t - start for t, chars in builds if chars == MAX_STOP_CHARS]
    assert len(long_builds) == 8
    # Two at once (the bucket), then one every 1/16 s: the eighth not before 6/16 s (a little slack for the clock).
    assert long_builds[-1] >= 6 / 16 - 0.02, long_builds
    assert short_done < long_builds[-1]  # the short list did not queue behind the flood


async def test_a_waiter_that_gives_up_frees_its_turn() -> None:
    """intake.Turns at one unit a second with room for one: the second waiter's turn is a second away; cancelled,
    the third takes that turn (about a second), not the one after it (two)."""
    turns = Turns(rate=1.0, burst=1.0)
    start = time.monotonic()
    await turns.wait(1)
    assert time.monotonic() - start < 0.2  # the bucket held it
    second = asyncio.ensure_future(turns.wait(1))
    await asyncio.sleep(0.05)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await turns.wait(1)
    assert 0.8 < time.monotonic() - start < 1.5
