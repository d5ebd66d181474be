"""The chats waiting in the HTTP server's own line count toward admission control (pass41).

A long chat the server renders itself (a stream's usage count, a Llama or Mistral tools chat) waits its turn in the
server's line, and enters it only when the engine's admission control has room for it then; but while it waited it
counted nowhere: with ``max_num_seqs + max_waiting_requests`` places, any number of such chats entered the line
while the engine was empty, each waited its turn (under a flood, hours), and only then was refused as overloaded,
where the engine refuses at once the call past the limit of those waiting their turn in its own lines
(docs/reliability.md, "Overload fails fast"). They are now in flight from the check to their submission.
"""

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
from tests.server.test_chat_flood_http import TEMPLATE, _body

from .conftest import LiveServer


@pytest.fixture
def live(tmp_path, monkeypatch):
    monkeypatch.setattr(asyncinfer.intake, "CHAT_MESSAGES_PER_S", 1.0)  # past its bucket, a long chat waits hours
    plain = tmp_path / "plain"
    tiny_hf_model("llama", vocab_size=320, max_position_embeddings=2 * MAX_CHAT_MESSAGES).save_pretrained(plain)
    model = with_chat_template(plain, tmp_path / "chat", TEMPLATE)
    options = {"dtype": "float32", "device": "cpu", "max_model_len": 2 * MAX_CHAT_MESSAGES, "kv_cache_memory": 64 << 20,
               "max_num_seqs": 1, "max_waiting_requests": 1}  # two places
    with LiveServer(create_app(ModelSpec(str(model), "chat", options))) as server:
        yield server


async def test_chats_waiting_in_the_servers_line_take_the_engines_places(live) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        for _ in range(2):  # the bucket's two: rendered to be counted, then too long for the model
            r = await http.post("/v1/chat/completions", json=_body(MAX_CHAT_MESSAGES))
            assert r.status_code == 400, r.text
        waiting = [asyncio.ensure_future(http.post("/v1/chat/completions", json=_body(CHAT_FREE_MESSAGES + 1, "hi")))
                   for _ in range(2)]  # the two places, both in the server's line
        await asyncio.sleep(0.5)
        assert not any(w.done() for w in waiting)
        start = time.monotonic()
        for body in (_body(CHAT_FREE_MESSAGES + 1, "hi"), _body(1, "hi")):  # a third long chat, or any request
            r = await http.post("/v1/chat/completions", json=body, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert time.monotonic() - start < 5
        for w in waiting:  # they leave: their places come back
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await asyncio.sleep(0.3)
        r = await http.post("/v1/chat/completions", json=_body(1, "hi"))
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
