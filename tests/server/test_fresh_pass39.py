"""A tools chat the HTTP server renders itself (a Mistral or Llama tools format) took its turn by its messages alone
(pass39): five messages whose assistant turn held thousands of tool calls (the body's 4 MiB holds ~45,000; 30,000
took 2.6 s of Mistral's template, holding the interpreter's lock) took none. Its turn counts the calls too
(``intake.chat_turn_size``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import asyncinfer.intake
import asyncinfer.server.router
from asyncinfer.prompts import MAX_CHAT_MESSAGES
from asyncinfer.server import ModelSpec, create_app
from tests.helpers import tiny_hf_model
from tests.server.test_tool_formats import MISTRAL_SPECIALS, MISTRAL_TEMPLATE, OPTIONS, ROLL, VOCAB, _tokenizer

from .conftest import LiveServer

LONG_CONTEXT = 65536
CALL = {"id": "a1B2c3D4e", "type": "function", "function": {"name": "roll_dice", "arguments": "{}"}}


@pytest.fixture
def rendered(monkeypatch) -> list[int]:
    """How many tool calls each chat the server rendered held."""
    seen: list[int] = []
    real = asyncinfer.server.router.render_chat

    def render(tokenizer, fmt, history, use):
        seen.append(sum(len(m.get("tool_calls") or ()) for m in history))
        return real(tokenizer, fmt, history, use)

    monkeypatch.setattr(asyncinfer.server.router, "render_chat", render)
    return seen


@pytest.fixture
def live(tmp_path, monkeypatch, rendered):
    monkeypatch.setattr(asyncinfer.intake, "CHAT_MESSAGES_PER_S", 1.0)  # past its bucket, a turn is hours away
    # a context whose characters hold the chat of thousands of calls, so that it is not refused by its size at once
    model = tiny_hf_model("mistral", 2, vocab_size=VOCAB, max_position_embeddings=LONG_CONTEXT)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path, safe_serialization=True)
    _tokenizer(MISTRAL_SPECIALS, "<s>", "</s>", MISTRAL_TEMPLATE).save_pretrained(tmp_path)
    options = {**OPTIONS, "max_model_len": LONG_CONTEXT, "kv_cache_memory": 64 << 20}
    with LiveServer(create_app(ModelSpec(str(tmp_path), "mistral", options))) as server:
        yield server


def _body(calls: int) -> dict:
    return {"model": "mistral", "max_tokens": 1, "tools": [ROLL], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL] * calls},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "4"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"}]}


async def test_a_tools_chat_of_many_calls_waits_its_turn(live, rendered) -> None:
    """Five messages, 8,292 calls (past the bucket's two chats at the limit): rendered at once (1.5 s, then refused
    for its length); now it waits its turn, and a tools chat of one call is answered meanwhile."""
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        many = asyncio.ensure_future(http.post("/v1/chat/completions", json=_body(2 * MAX_CHAT_MESSAGES + 100)))
        await asyncio.sleep(1.0)
        short = await http.post("/v1/chat/completions", json=_body(1))  # five messages, one call: never waits
        assert short.status_code == 200, short.text
        assert rendered == [1], "a chat of thousands of tool calls took no turn"
        assert not many.done()
        many.cancel()
        with pytest.raises(asyncio.CancelledError):
            await many
