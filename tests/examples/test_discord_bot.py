"""examples/discord_bot.py driven by fake Discord messages (no discord.py, no network), on the real model:
streamed replies edited at a bounded rate, per-channel histories within the token budget, !reset, !stop,
and per-user priorities."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams

pytestmark = pytest.mark.real_model

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


async def test_streamed_reply_with_rate_limited_edits_and_channel_memory(example, real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=1024, scheduler="aging-priority") as engine:
        bot = example.ChatBot(engine, params=GREEDY, edit_interval=0.2)
        first = Message("What is the capital of France?", ANN, Channel(10))
        await bot.on_message(first)
        (reply,) = first.replies
        expected = [{"role": "system", "content": example.SYSTEM_PROMPT},
                    {"role": "user", "content": "ann: What is the capital of France?"}]
        want = await engine.generate(expected, GREEDY)
        assert reply.content == want.text  # the final edit is the whole answer, exactly
        times = [t for t, _ in reply.edits]
        assert all(b - a >= 0.2 for a, b in zip(times, times[1:-1]))  # at most one edit per interval
        assert all(c.endswith(" …") for _, c in reply.edits[:-1])  # "still writing" until the last edit

        follow = Message("And of Italy?", BOB, Channel(10))
        await bot.on_message(follow)
        history = expected + [{"role": "assistant", "content": want.text},
                              {"role": "user", "content": "bob: And of Italy?"}]
        assert follow.replies[0].content == (await engine.generate(history, GREEDY)).text
        other = Message("Hello", ANN, Channel(11))  # another channel starts empty
        await bot.on_message(other)
        assert [m["content"] for m in bot.histories[11]] == ["ann: Hello", other.replies[0].content]

        reset = Message("!reset", ANN, Channel(10))
        await bot.on_message(reset)
        assert reset.replies[0].content == "History cleared." and bot.histories.get(10) is None
        await bot.on_message(Message("ignored", Author(3, "a bot", bot=True), Channel(10)))
        assert bot.histories.get(10) is None


async def test_history_is_trimmed_to_the_token_budget(example, real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=1024) as engine:
        bot = example.ChatBot(engine, params=SamplingParams(max_tokens=4), history_budget=120)
        for i in range(8):
            await bot.on_message(Message(f"Tell me fact number {i} about cats, please.", ANN, Channel(5)))
        prompt = bot.prompt_for(5)
        assert engine.count_tokens(prompt) <= 120
        assert prompt[0]["role"] == "system" and prompt[1]["role"] == "user"
        assert prompt[-2]["content"] == "ann: Tell me fact number 7 about cats, please."
        assert len(prompt) < 1 + 2 * 8  # older turns are gone
        long = Message("word " * 400, ANN, Channel(6))
        await bot.on_message(long)
        assert long.replies[0].content == "That message is too long for me, sorry." and bot.histories[6] == []


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


def test_the_gateway_part_needs_discord_only_when_run() -> None:
    source = EXAMPLE.read_text()
    assert "import discord\n" not in source.split("def main()")[0]  # the bot logic imports no discord
