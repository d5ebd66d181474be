"""Turns given up in the middle of the line (pass39). ``intake.Turns`` gave a waiter's turn back only when it was the
last in line: a caller that kept two requests with long stop lists (or long chats) waiting, and gave up the earlier
one each time it sent the next, moved the bucket's clock on by a whole turn per request without anything reaching
the engine. Ten rounds of it made the next long list wait ten turns; at the real rates a client holding two places
over HTTP (the wait ends when it leaves) pushed every other caller's long list or long chat hours away. A waiter
that gives up now gives its turn back wherever it stands in line."""

from __future__ import annotations

import asyncio
import time

import pytest

import asyncinfer.intake
from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.intake import Turns
from asyncinfer.sampling_params import MAX_STOP_CHARS
from tests.helpers import ENGINE_BASE

ROUNDS = 10


async def _give_up(task: asyncio.Future) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_waiters_given_up_mid_line_give_their_turns_back() -> None:
    """One unit a second with room for one: two waiters in line, the earlier given up as each next one comes, ten
    times; the next waiter then waits about one turn, not ten."""
    turns = Turns(rate=1.0, burst=1.0)
    await turns.wait(1)  # the bucket's
    previous = asyncio.ensure_future(turns.wait(1))
    await asyncio.sleep(0.01)
    for _ in range(ROUNDS):
        following = asyncio.ensure_future(turns.wait(1))
        await asyncio.sleep(0.01)
        await _give_up(previous)  # not the last in line: 'following' stands behind it
        previous = following
    await _give_up(previous)
    start = time.monotonic()
    await asyncio.wait_for(turns.wait(1), 3)  # ten turns given up before it: it waited about ten seconds
    assert time.monotonic() - start < 1.5


def _stops(variant: int) -> list[str]:
    return [chr(0xE000 + variant) * MAX_STOP_CHARS]


async def test_a_caller_giving_up_its_waits_does_not_push_others_long_lists_away(tiny_models, monkeypatch) -> None:
    """A list at the limit is one turn a second here; a caller keeps two such requests waiting and gives up the
    earlier each time (ten rounds). Another caller's long list then waits about a turn, not ten."""
    monkeypatch.setattr(asyncinfer.intake, "STOP_BUILD_CHARS_PER_S", MAX_STOP_CHARS)
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE) as engine:
        for i in range(2):  # the bucket's two
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=_stops(i)))

        def send(i: int) -> asyncio.Future:
            return asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=_stops(i))))

        previous = send(2)
        await asyncio.sleep(0.01)
        for i in range(ROUNDS):
            following = send(3 + i)
            await asyncio.sleep(0.01)
            await _give_up(previous)
            previous = following
        await _give_up(previous)
        start = time.monotonic()
        out = await asyncio.wait_for(engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=_stops(99))), 4)
        assert time.monotonic() - start < 2.0
        assert out.outputs[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("how", ["generate", "stream"])
async def test_an_abort_ends_a_request_waiting_its_turn_at_once(tiny_models, monkeypatch, how) -> None:
    """abort(id) of a request waiting its turn (a list at the limit, twenty seconds a turn here): it waited its whole
    turn (minutes under a flood) and only then ended as an abort. It ends as one within a check (0.25 s), n samples
    each (nothing generated; its prompt's ids if they were made at the call)."""
    monkeypatch.setattr(asyncinfer.intake, "STOP_BUILD_CHARS_PER_S", MAX_STOP_CHARS / 20)
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE) as engine:
        for i in range(2):  # the bucket's two
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=1, stop=_stops(i)))
        params = SamplingParams(max_tokens=1, n=2, stop=_stops(5))
        if how == "generate":
            waiter = asyncio.ensure_future(engine.generate([5, 6, 7], params, request_id="victim"))
        else:
            async def read() -> list:
                return [d async for d in engine.stream([5, 6, 7], params, request_id="victim")]
            waiter = asyncio.ensure_future(read())
        await asyncio.sleep(0.1)
        start = time.monotonic()
        engine.abort("victim")
        got = await asyncio.wait_for(waiter, 5)
        assert time.monotonic() - start < 1.0
        if how == "generate":
            assert [c.finish_reason for c in got.outputs] == ["abort", "abort"]
            assert got.prompt_token_ids == [5, 6, 7] and got.outputs[0].token_ids == []
        else:
            assert sorted((d.index, d.finish_reason) for d in got) == [(0, "abort"), (1, "abort")]
        assert engine.num_unfinished_requests == 0
