"""The chats the HTTP server renders itself (a stream's usage count, a Llama/Mistral tools chat) take their turns
too: a flood of 4096-message streamed chats with ``include_usage``, each rendered by the server in a worker thread
and then refused for its length, went around the engine's own turns (the server hands it token ids)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import asyncinfer.intake
from asyncinfer.intake import CHAT_FREE_MESSAGES
from asyncinfer.prompts import MAX_CHAT_MESSAGES
from asyncinfer.server import ModelSpec, create_app
from tests.helpers import tiny_hf_model, with_chat_template

from .conftest import LiveServer

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture
def live(tmp_path, monkeypatch):
    monkeypatch.setattr(asyncinfer.intake, "CHAT_MESSAGES_PER_S", 1.0)  # past its bucket, a long chat waits
    plain = tmp_path / "plain"
    tiny_hf_model("llama", vocab_size=320, max_position_embeddings=2 * MAX_CHAT_MESSAGES).save_pretrained(plain)
    model = with_chat_template(plain, tmp_path / "chat", TEMPLATE)
    options = {"dtype": "float32", "device": "cpu", "max_model_len": 2 * MAX_CHAT_MESSAGES, "kv_cache_memory": 64 << 20}
    with LiveServer(create_app(ModelSpec(str(model), "chat", options))) as server:
        yield server


def _body(messages: int, content: str = "") -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": content}] * messages, "max_tokens": 1,
            "stream": True, "stream_options": {"include_usage": True}}


async def test_long_chats_the_server_renders_wait_their_turn(live) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        for _ in range(2):  # the bucket's two: rendered to be counted, then too long for the model
            r = await http.post("/v1/chat/completions", json=_body(MAX_CHAT_MESSAGES))
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        third = asyncio.ensure_future(http.post("/v1/chat/completions", json=_body(MAX_CHAT_MESSAGES)))
        start = time.monotonic()
        short = await http.post("/v1/chat/completions", json=_body(CHAT_FREE_MESSAGES, "hi"))
        assert short.status_code == 200 and short.text.endswith("data: [DONE]\n\n")
        await asyncio.sleep(0.5)
        assert not third.done(), "the third long chat did not wait its turn"
        assert time.monotonic() - start < 30
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third


async def test_a_long_chat_is_refused_before_its_turn_when_the_engine_is_full(tmp_path, monkeypatch) -> None:
    """Admission control first: with every place taken, a long chat the server would render is a 503 at once, not
    after its wait in the server's line (at this rate, an hour)."""
    monkeypatch.setattr(asyncinfer.intake, "CHAT_MESSAGES_PER_S", 1.0)
    plain = tmp_path / "plain"
    tiny_hf_model("llama", vocab_size=320, max_position_embeddings=2 * MAX_CHAT_MESSAGES).save_pretrained(plain)
    model = with_chat_template(plain, tmp_path / "chat", TEMPLATE)
    options = {"dtype": "float32", "device": "cpu", "max_model_len": 2 * MAX_CHAT_MESSAGES, "kv_cache_memory": 64 << 20,
               "max_num_seqs": 1, "max_waiting_requests": 0}
    with LiveServer(create_app(ModelSpec(str(model), "chat", options))) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
            for _ in range(2):  # the bucket's two
                r = await http.post("/v1/chat/completions", json=_body(MAX_CHAT_MESSAGES))
                assert r.status_code == 400, r.text
            long_body = {**_body(2, "hi"), "max_tokens": 200, "ignore_eos": True}
            async with http.stream("POST", "/v1/chat/completions", json=long_body) as running:  # the one place
                assert running.status_code == 200
                start = time.monotonic()
                r = await http.post("/v1/chat/completions", json=_body(CHAT_FREE_MESSAGES + 1, "hi"), timeout=10)
                assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
                assert time.monotonic() - start < 5
