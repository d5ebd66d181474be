"""A tools chat the HTTP server renders itself (a Mistral or Llama tools model) is refused by its characters before
it is rendered, as the engine refuses any other chat: five messages of 3.9 MB took 7.5 s of template and tokenizer
to be refused for their length (the same text without tools: 0.05 s; pass39)."""

from __future__ import annotations

import time

import httpx
import pytest

from asyncinfer.server import ModelSpec, create_app
from tests.helpers import tiny_hf_model
from tests.server.test_tool_formats import MISTRAL_SPECIALS, MISTRAL_TEMPLATE, OPTIONS, ROLL, VOCAB, _tokenizer

from .conftest import LiveServer


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    model = tiny_hf_model("mistral", 2, vocab_size=VOCAB, max_position_embeddings=4096)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(MISTRAL_SPECIALS, "<s>", "</s>", MISTRAL_TEMPLATE).save_pretrained(path)
    with LiveServer(create_app(ModelSpec(str(path), "mistral", OPTIONS))) as server:
        yield server


@pytest.mark.parametrize("stream", [False, True])
def test_a_tools_chat_too_long_by_its_characters_is_refused_before_its_template(live, stream) -> None:
    big = "word " * 780_000  # 3.9 MB
    body = {"model": "mistral", "max_tokens": 1, "tools": [ROLL], "stream": stream,
            "messages": [{"role": "user", "content": big}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "go"}]}
    start = time.monotonic()
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120)
    took = time.monotonic() - start
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "messages"
    assert took < 2.0, took  # the body's own parsing and the character count, no template
