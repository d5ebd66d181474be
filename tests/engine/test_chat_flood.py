"""A flood of chats of thousands of messages, each templated in a worker thread (Jinja, holding the interpreter's
lock against the engine thread and the loop) and then refused for its length: a neighbour's tokens came 1.5-2.3x
slower beside it (benchmarks/isolation.py, case chats). Chats over intake.CHAT_FREE_MESSAGES messages now reach the
template at a bounded rate (intake.CHAT_MESSAGES_PER_S, a bucket of two chats at the limit): the flood waits its
turn, and a short chat never waits."""

from __future__ import annotations

import asyncio
import time

import pytest

import asyncinfer.intake
from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.intake import CHAT_FREE_MESSAGES
from asyncinfer.prompts import MAX_CHAT_MESSAGES
from tests.helpers import ENGINE_BASE, tiny_hf_model, with_chat_template

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny model whose context holds a chat at the message limit, so that such a chat is templated (a shorter
    context refuses it by its size, before any template)."""
    plain = tmp_path_factory.mktemp("long") / "m"
    tiny_hf_model("llama", vocab_size=320, max_position_embeddings=2 * MAX_CHAT_MESSAGES).save_pretrained(plain)
    return with_chat_template(plain, tmp_path_factory.mktemp("chat") / "m", TEMPLATE)


LONG_CHAT = [{"role": "user", "content": ""}] * MAX_CHAT_MESSAGES


def _options() -> dict:
    return {**ENGINE_BASE, "max_model_len": 2 * MAX_CHAT_MESSAGES, "kv_cache_memory": 64 << 20}


async def test_long_chats_reach_the_template_at_a_bounded_rate(chat_model, monkeypatch) -> None:
    monkeypatch.setattr(asyncinfer.intake, "CHAT_MESSAGES_PER_S", 16 * MAX_CHAT_MESSAGES)  # one every 1/16 s
    async with await AsyncEngine.load(chat_model, **_options()) as engine:
        start = time.monotonic()
        refused: list[float] = []

        async def send() -> None:
            with pytest.raises(InvalidParameterError, match="prompt"):  # templated, then too long for the model
                await engine.generate(LONG_CHAT, SamplingParams(max_tokens=1))
            refused.append(time.monotonic() - start)

        await asyncio.gather(*(send() for _ in range(8)))
    refused.sort()
    assert refused[-1] >= 6 / 16 - 0.02, refused  # two at once (the bucket), then one every 1/16 s


async def test_a_short_chat_never_waits_behind_long_ones(chat_model, monkeypatch) -> None:
    monkeypatch.setattr(asyncinfer.intake, "CHAT_MESSAGES_PER_S", 1.0)  # past the bucket, a long chat waits hours
    short_chat = [{"role": "user", "content": "hi"}] * CHAT_FREE_MESSAGES
    async with await AsyncEngine.load(chat_model, **_options()) as engine:
        for _ in range(2):  # the bucket's two
            with pytest.raises(InvalidParameterError, match="prompt"):
                await engine.generate(LONG_CHAT, SamplingParams(max_tokens=1))
        third = asyncio.ensure_future(engine.generate(LONG_CHAT, SamplingParams(max_tokens=1)))
        out = await asyncio.wait_for(engine.generate(short_chat, SamplingParams(max_tokens=1, ignore_eos=True)), 30)
        assert len(out.outputs[0].token_ids) == 1 and not third.done()  # served while the third waits its turn
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third
