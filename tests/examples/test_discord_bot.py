"""examples/discord_bot.py driven by fake Discord messages (no discord.py, no network), on the real model:
streamed replies edited at a bounded rate, per-channel histories within the token budget, !reset, !stop,
and per-user priorities; on a fake engine (no model): a channel's replies one at a time in arrival order,
!reset during a reply, and the engine's refusals as short replies."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest

from asyncinfer import AsyncEngine, EngineOverloadedError, InvalidParameterError, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "discord_bot.py"
GREEDY = SamplingParams(max_tokens=24)


def load_example():
    spec = importlib.util.spec_from_file_location("discord_bot_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Author:
    id: int
    display_name: str
    bot: bool = False


@dataclass
class Channel:
    id: int


@dataclass
class Sent:
    """A message the bot posted; every edit is kept with its time."""

    content: str
    edits: list[tuple[float, str]] = field(default_factory=list)

    async def edit(self, *, content: str) -> None:
        self.edits.append((time.monotonic(), content))
        self.content = content


@dataclass
class Message:
    content: str
    author: Author
    channel: Channel
    replies: list[Sent] = field(default_factory=list)

    async def reply(self, text: str) -> Sent:
        self.replies.append(Sent(text))
        return self.replies[-1]


ANN, BOB = Author(1, "ann"), Author(2, "bob")


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.mark.real_model
async def test_streamed_reply_with_rate_limited_edits_and_channel_memory(example, real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=1024, scheduler="aging-priority") as engine:
        bot = example.ChatBot(engine, params=GREEDY, edit_interval=0.2)
        first = Message("What is the capital of France?", ANN, Channel(10))
        await bot.on_message(first)
        (reply,) = first.replies
        expected = [{"role": "system", "content": example.SYSTEM_PROMPT},
                    {"role": "user", "content": "What is the capital of France?", "name": "ann"}]
        want = await engine.generate(expected, GREEDY)
        assert reply.content == want.text  # the final edit is the whole answer, exactly
        times = [t for t, _ in reply.edits]
        assert all(b - a >= 0.2 for a, b in itertools.pairwise(times[:-1]))  # at most one edit per interval
        assert all(c.endswith(" …") for _, c in reply.edits[:-1])  # "still writing" until the last edit

        follow = Message("And of Italy?", BOB, Channel(10))
        await bot.on_message(follow)
        history = expected + [{"role": "assistant", "content": want.text},
                              {"role": "user", "content": "And of Italy?", "name": "bob"}]
        assert follow.replies[0].content == (await engine.generate(history, GREEDY)).text
        other = Message("Hello", ANN, Channel(11))  # another channel starts empty
        await bot.on_message(other)
        assert [m["content"] for m in bot.histories[11]] == ["Hello", other.replies[0].content]

        reset = Message("!reset", ANN, Channel(10))
        await bot.on_message(reset)
        assert reset.replies[0].content == "History cleared." and bot.histories.get(10) is None
        await bot.on_message(Message("ignored", Author(3, "a bot", bot=True), Channel(10)))
        assert bot.histories.get(10) is None


@pytest.mark.real_model
async def test_history_is_trimmed_to_the_token_budget(example, real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=1024) as engine:
        bot = example.ChatBot(engine, params=SamplingParams(max_tokens=4), history_budget=120)
        for i in range(8):
            await bot.on_message(Message(f"Tell me fact number {i} about cats, please.", ANN, Channel(5)))
        prompt = bot.prompt_for(5)
        assert engine.count_tokens(prompt) <= 120
        assert prompt[0]["role"] == "system" and prompt[1]["role"] == "user"
        assert prompt[-2] == {"role": "user", "content": "Tell me fact number 7 about cats, please.", "name": "ann"}
        assert len(prompt) < 1 + 2 * 8  # older turns are gone
        long = Message("word " * 400, ANN, Channel(6))
        await bot.on_message(long)
        assert long.replies[0].content == "That message is too long for me, sorry." and bot.histories[6] == []


@pytest.mark.real_model
async def test_stop_aborts_only_the_users_reply_and_priorities_follow_load(example, real_gguf) -> None:
    endless = SamplingParams(max_tokens=900, ignore_eos=True)
    async with await AsyncEngine.load(real_gguf, max_model_len=1024, scheduler="aging-priority") as engine:
        bot = example.ChatBot(engine, params=endless, edit_interval=0.1)
        seen: list[tuple[str, int]] = []
        stream = engine.stream

        def spy(prompt, params, *, request_id, priority):
            seen.append((request_id, priority))
            return stream(prompt, params, request_id=request_id, priority=priority)

        engine.stream = spy
        ann1, ann2 = Message("Count to a thousand.", ANN, Channel(1)), Message("Again.", ANN, Channel(2))
        bob = Message("Say something long.", BOB, Channel(3))
        tasks = [asyncio.create_task(bot.on_message(m)) for m in (ann1, ann2, bob)]
        while len(seen) < 3 or not all(m.replies and m.replies[0].edits for m in (ann1, ann2, bob)):
            await asyncio.sleep(0.05)
        assert sorted(seen) == [("1/1", 0), ("1/2", 1), ("2/3", 0)]  # ann's second request waits behind bob
        assert bot.priority(ANN.id) == 2 and bot.priority(BOB.id) == 1
        await bot.on_message(Message("!stop", ANN, Channel(1)))
        await asyncio.gather(*tasks[:2])
        assert all(m.replies[0].content.endswith(" [stopped]") for m in (ann1, ann2))
        assert not tasks[2].done() and bot.priority(ANN.id) == 0
        await bot.on_message(Message("!stop", BOB, Channel(3)))
        await tasks[2]
        for _ in range(100):  # the engine thread confirms the aborts at its next step boundary
            if engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0


@pytest.mark.real_model
async def test_roll_is_a_tool_call_the_bot_runs(example, real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=1024) as engine:
        bot = example.ChatBot(engine, dice=random.Random(5))
        message = Message("!roll two twenty-sided dice plus 3", ANN, Channel(12))
        await bot.on_message(message)
        prompt = [{"role": "system", "content": example.ROLL_PROMPT},
                  {"role": "user", "content": "two twenty-sided dice plus 3"}]
        call = await engine.generate(prompt, example.ROLL_PARAMS)
        assert call.finish_reason == "stop"
        parsed = json.loads(call.text)  # the model's call: parses, names the tool, arguments in range
        assert parsed["name"] == "roll_dice"
        jsonschema.validate(parsed["arguments"], example.ROLL_TOOL["parameters"])
        args = parsed["arguments"]
        (reply,) = message.replies
        assert reply.content == example.roll_dice(random.Random(5), args["count"], args["sides"], args["modifier"])
        assert re.fullmatch(r"🎲 \d+d\d+([+-]\d+)?: .* = -?\d+", reply.content)
        assert bot.histories.get(12) is None  # rolls stay out of the history


async def test_roll_runs_the_call_and_refuses_a_cut_one(example) -> None:
    engine = FakeEngine()
    bot = example.ChatBot(engine, dice=random.Random(1))
    engine.calls = [Out('{"name": "roll_dice", "arguments": {"count": 2, "sides": 6, "modifier": -1}}', "stop"),
                    Out('{"name": "roll_dice", "arguments": {"count": 2', "length")]
    first, cut = Message("!roll 2d6-1", ANN, Channel(3)), Message("!roll", ANN, Channel(3))
    await bot.on_message(first)
    await bot.on_message(cut)
    dice = random.Random(1)
    faces = [dice.randint(1, 6), dice.randint(1, 6)]
    assert first.replies[0].content == f"🎲 2d6-1: {faces[0]} + {faces[1]} - 1 = {sum(faces) - 1}"
    assert cut.replies[0].content == "Sorry, I could not read that roll."
    assert [p[-1]["content"] for p in engine.generated] == ["2d6-1", "one six-sided die"]
    assert example.roll_dice(random.Random(2), 1, 20, 0).startswith("🎲 1d20: ")


def test_the_gateway_part_needs_discord_only_when_run() -> None:
    source = EXAMPLE.read_text()
    assert "import discord\n" not in source.split("def main()")[0]  # the bot logic imports no discord


class FakeEngine:
    """What ChatBot uses of the engine: a reply per request, released piece by piece by the test
    (``release``) or at once, or an error raised by the stream (``fail``)."""

    max_model_len = 1024

    def __init__(self, *, hold: bool = False) -> None:
        self.hold = hold
        self.prompts: dict[str, list[dict[str, str]]] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: dict[str, Exception] = {}
        self.calls: list[Out] = []  # generate()'s answers, in order
        self.generated: list[list[dict[str, str]]] = []

    async def generate(self, prompt, params, *, priority):
        self.generated.append(list(prompt))
        return self.calls.pop(0)

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return sum(len(m["content"].split()) + 2 for m in messages)

    async def stream(self, prompt, params, *, request_id, priority):
        self.prompts[request_id] = list(prompt)
        self.gates.setdefault(request_id, asyncio.Event())
        if request_id in self.fail:
            raise self.fail[request_id]
        yield Delta("re:")
        if self.hold:
            await self.gates[request_id].wait()
        yield Delta(" " + prompt[-1]["content"])

    def release(self, request_id: str) -> None:
        self.gates.setdefault(request_id, asyncio.Event()).set()


@dataclass
class Delta:
    text: str


@dataclass
class Out:
    text: str
    finish_reason: str


async def wait_for(condition) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    """``("ann: q0", "re: q0")`` -> ann's user turn ``q0`` (her name in ``name``) and the reply."""
    return [m for said, reply in pairs for name, text in [said.split(": ", 1)]
            for m in ({"role": "user", "content": text, "name": name}, {"role": "assistant", "content": reply})]


async def test_a_channel_answers_its_messages_one_at_a_time_in_arrival_order(example) -> None:
    engine = FakeEngine(hold=True)
    bot = example.ChatBot(engine, params=GREEDY, edit_interval=0)
    messages = [Message(f"q{i}", author, Channel(7)) for i, author in enumerate((ANN, BOB, ANN))]
    tasks = [asyncio.create_task(bot.on_message(m)) for m in messages]
    await wait_for(lambda: all(m.replies for m in messages) and "1/1" in engine.prompts)
    assert [m.replies[0].content for m in messages] == ["re: …", "…", "…"]  # all acknowledged at once
    assert list(engine.prompts) == ["1/1"]  # the others wait for their turn
    engine.release("1/3")  # a later message finishing first changes nothing: it has not started
    engine.release("2/2")
    engine.release("1/1")
    await asyncio.gather(*tasks)
    system = [{"role": "system", "content": example.SYSTEM_PROMPT}]
    expected = turns(("ann: q0", "re: q0"), ("bob: q1", "re: q1"), ("ann: q2", "re: q2"))
    assert bot.histories[7] == expected
    assert [m.replies[0].content for m in messages] == [t["content"] for t in expected[1::2]]
    assert engine.prompts == {"1/1": system + expected[:1], "2/2": system + expected[:3],
                              "1/3": system + expected[:5]}


async def test_reset_during_a_reply_keeps_it_and_the_queued_ones_out_of_the_new_history(example) -> None:
    engine = FakeEngine(hold=True)
    bot = example.ChatBot(engine, params=GREEDY, edit_interval=0)
    before = [Message("old question", ANN, Channel(8)), Message("queued question", BOB, Channel(8))]
    tasks = [asyncio.create_task(bot.on_message(m)) for m in before]
    await wait_for(lambda: "1/1" in engine.prompts)
    reset = Message("!reset", ANN, Channel(8))
    await bot.on_message(reset)
    after = Message("new question", ANN, Channel(8))
    tasks.append(asyncio.create_task(bot.on_message(after)))
    for request_id in ("1/1", "2/2", "1/3"):
        engine.release(request_id)
    await asyncio.gather(*tasks)
    assert reset.replies[0].content == "History cleared."
    assert [m.replies[0].content for m in (*before, after)] == ["re: old question", "re: queued question",
                                                                "re: new question"]  # all answered
    system = [{"role": "system", "content": example.SYSTEM_PROMPT}]
    assert engine.prompts["2/2"] == system + [{"role": "user", "content": "queued question", "name": "bob"}]
    assert bot.histories[8] == turns(("ann: new question", "re: new question"))


@pytest.mark.parametrize("error, shown", [
    (EngineOverloadedError("too many requests waiting"), "I'm busy right now, please try again in a moment."),
    (InvalidParameterError("max_tokens", 5000, "<= 1000"), "Sorry, I could not answer that."),
    (RuntimeError("the step loop died"), "Sorry, I could not answer that."),
])
async def test_an_engine_error_becomes_a_short_reply_and_leaves_no_trace(example, error, shown, caplog) -> None:
    engine = FakeEngine()
    bot = example.ChatBot(engine, params=GREEDY, edit_interval=0)
    engine.fail["1/1"] = error
    failed = Message("first", ANN, Channel(9))
    await bot.on_message(failed)  # does not raise
    assert [r.content for r in failed.replies] == [shown]
    assert bot.histories[9] == [] and bot.priority(ANN.id) == 0
    assert any("1/1" in r.getMessage() and str(error) in r.getMessage() for r in caplog.records)
    ok = Message("second", ANN, Channel(9))
    await bot.on_message(ok)
    assert ok.replies[0].content == "re: second"
    assert bot.histories[9] == turns(("ann: second", "re: second"))


async def test_stop_on_a_queued_message_keeps_the_order_of_the_rest(example) -> None:
    engine = FakeEngine(hold=True)
    bot = example.ChatBot(engine, params=GREEDY, edit_interval=0)
    first, queued, last = Message("a", ANN, Channel(4)), Message("b", BOB, Channel(4)), Message("c", ANN, Channel(4))
    tasks = [asyncio.create_task(bot.on_message(m)) for m in (first, queued, last)]
    await wait_for(lambda: "1/1" in engine.prompts and queued.replies)
    await bot.on_message(Message("!stop", BOB, Channel(4)))
    await tasks[1]
    assert queued.replies[0].content == "(no answer) [stopped]" and "2/2" not in engine.prompts
    await asyncio.sleep(0.05)
    assert list(engine.prompts) == ["1/1"]  # the last message still waits for the first
    engine.release("1/1")
    engine.release("1/3")
    await asyncio.gather(*tasks)
    assert bot.histories[4] == turns(("ann: a", "re: a"), ("ann: c", "re: c"))


@pytest.mark.parametrize("failure, said", [
    ("login", "Discord refused DISCORD_TOKEN (Improper token has been passed.)"),
    ("network", "cannot reach Discord (Cannot connect to host discord.com:443)"),
])
def test_a_bad_token_or_no_network_is_one_line_not_a_traceback(example, monkeypatch, failure, said) -> None:
    discord = pytest.importorskip("discord")
    aiohttp = pytest.importorskip("aiohttp")
    error = (discord.LoginFailure("Improper token has been passed.") if failure == "login"
             else aiohttp.ClientConnectionError("Cannot connect to host discord.com:443"))

    def run(self, token, **kwargs):
        raise error

    monkeypatch.setattr(discord.Client, "run", run)
    monkeypatch.setenv("DISCORD_TOKEN", "not-a-token")
    monkeypatch.setattr("sys.argv", ["discord_bot.py"])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert str(exit_.value.code).startswith(said) and "\n" not in str(exit_.value.code)


@pytest.mark.parametrize("token", [None, "", " ", "\n"])
def test_no_token_is_refused_before_the_model_loads(example, monkeypatch, token) -> None:
    """No token, or one of blanks only (a copy gone wrong), is refused at once: a blank one was sent to Discord after
    the model had loaded."""
    discord = pytest.importorskip("discord")

    def run(self, token, **kwargs):
        raise AssertionError("reached Discord")

    monkeypatch.setattr(discord.Client, "run", run)
    if token is None:
        monkeypatch.delenv("DISCORD_TOKEN", raising=False)
    else:
        monkeypatch.setenv("DISCORD_TOKEN", token)
    monkeypatch.setattr("sys.argv", ["discord_bot.py"])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == "set DISCORD_TOKEN to the bot's token"
