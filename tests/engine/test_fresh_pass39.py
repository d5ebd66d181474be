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
from tests.helpers import ENGINE_BASE, CharTokenizer, fill_stop_turns, send_victim

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
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    engine.core.tokenizer = CharTokenizer()  # stop strings need a tokenizer (a model without one refuses them)
    async with engine:
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
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    engine.core.tokenizer = CharTokenizer()  # stop strings need a tokenizer (a model without one refuses them)
    async with engine:
        await fill_stop_turns(engine, _stops)
        params = SamplingParams(max_tokens=1, n=2, stop=_stops(5))
        waiter = send_victim(engine, params, how)
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


TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tests.helpers import tiny_hf_model, with_chat_template

    plain = tmp_path_factory.mktemp("plain39") / "m"
    tiny_hf_model("llama", vocab_size=320).save_pretrained(plain)
    return with_chat_template(plain, tmp_path_factory.mktemp("chat39") / "m", TEMPLATE)


def test_a_chats_turn_counts_the_tool_calls_it_holds() -> None:
    from asyncinfer.intake import chat_turn_size

    call = {"id": "a1B2c3D4e", "type": "function", "function": {"name": "f", "arguments": {}}}
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call] * 300},
            {"role": "user", "content": "go"}]
    assert chat_turn_size(chat) == 303
    assert chat_turn_size(tuple(chat)) == 303 and chat_turn_size("text") == 0 and chat_turn_size([5, 6]) == 0


async def test_a_short_chat_of_many_tool_calls_waits_its_turn(chat_model, monkeypatch) -> None:
    """Three messages, the assistant's holding more tool calls than the bucket's two chats at the limit: a template
    renders every call (30,000 of them, 2.6 s of Mistral's), and such a chat took no turn at all. It waits its turn
    as a chat of as many messages does; a chat of three plain messages still never waits."""
    monkeypatch.setattr(asyncinfer.intake, "CHAT_MESSAGES_PER_S", 1.0)  # past the bucket, a turn is hours away
    from asyncinfer.prompts import MAX_CHAT_MESSAGES

    call = {"id": "a1B2c3D4e", "type": "function", "function": {"name": "f", "arguments": {}}}
    many = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call] * (2 * MAX_CHAT_MESSAGES + 100)},
            {"role": "user", "content": "go"}]
    options = {**ENGINE_BASE, "max_model_len": 256}
    async with AsyncEngine.from_pretrained(chat_model, **options) as engine:
        waiter = asyncio.ensure_future(engine.generate(many, SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.5)
        plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                 {"role": "user", "content": "go"}]
        out = await asyncio.wait_for(engine.generate(plain, SamplingParams(max_tokens=1, ignore_eos=True)), 30)
        assert len(out.outputs[0].token_ids) == 1
        assert not waiter.done(), "a chat of thousands of tool calls took no turn"
        await _give_up(waiter)
