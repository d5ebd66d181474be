"""Admission control (``max_waiting_requests``) counts the requests waiting their turn (intake.Turns) and those
being bound off the loop as in flight: they were not counted until posted, so a flood of long stop lists, each
waiting its turn, passed the check at its call, waited its whole turn (under a flood, minutes) and only then was
refused as overloaded, or admitted past the bound, and any number of them could wait at once. Now the call past the
limit is refused at once, and the count goes back down as waiters are bound or give up."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncinfer import EngineOverloadedError, SamplingParams
from tests.helpers import fill_stop_turns, long_stops, slow_stop_turns_engine


async def test_a_flood_waiting_its_turns_counts_toward_the_limit(tiny_models, monkeypatch) -> None:
    engine = slow_stop_turns_engine(tiny_models["llama"][0], monkeypatch)  # 4 places; a long list every 4 s
    async with engine:
        await fill_stop_turns(engine, long_stops)
        waiters = [asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=long_stops(2 + i))))
                   for i in range(4)]  # the limit: max_num_seqs + max_waiting_requests = 4, all waiting their turn
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waiters)
        start = time.monotonic()
        with pytest.raises(EngineOverloadedError):  # a fifth, even an ordinary one, is refused at once
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=1))
        with pytest.raises(EngineOverloadedError):
            engine.check_admission(1)
        assert time.monotonic() - start < 1.0
        for w in waiters:  # the waiters give up: the count goes back down
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=1))
        assert out.outputs[0].finish_reason == "length"
        engine.check_admission(4)  # nothing is counted any more
