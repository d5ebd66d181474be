"""A fourth fresh adversarial pass (issue 25): what one caller's request can do to another's, and whether each
refusal names its field. Each case here was a fault on main before it was fixed."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from asyncinfer.server import create_app
from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import CHAT_BODY, COMPLETION_BODY, EMBEDDING_BODY, decode_json
from asyncinfer.server.settings import ModelSpec
from tests.helpers import hold_swap_loads

from .conftest import TINY_OPTIONS, LiveServer

# An escaped lone surrogate is valid JSON grammar but no valid Unicode text; msgspec refuses the body, and the
# 400 said only "The request body is not valid JSON" (param null). The issue: errors name the parameter.
LONE = [  # (shape, body, param)
    ("text", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("text", b'{"prompt": ["ok", "\\udfff"]}', "prompt.[1]"),
    ("text", b'{"prompt": "x", "stop": ["fine", "\\ud800"]}', "stop.[1]"),
    ("text", b'{"prompt": "x", "user": "\\udc00"}', "user"),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\ud800"}]}',
     "messages.[1].content"),
    ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.[0].content.[0].text"),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("embed", b'{"model": "minilm", "input": ["a", "b", "\\udbff"]}', "input.[2]"),
]
SHAPES = {"text": COMPLETION_BODY, "chat": CHAT_BODY, "embed": EMBEDDING_BODY}
ROUTES = {"text": "/v1/completions", "chat": "/v1/chat/completions", "embed": "/v1/embeddings"}


@pytest.mark.parametrize(("shape", "body", "param"), LONE, ids=[p for _, _, p in LONE])
def test_a_lone_surrogate_is_a_400_naming_its_field(shape, body, param) -> None:
    with pytest.raises(APIError) as refused:
        decode_json(body, SHAPES[shape])
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message
    assert "lone surrogate" in refused.value.message


@pytest.mark.parametrize("body", [b'{"prompt": "x"', b'{"prompt": NaN}', b'{"prompt": "\\ud83d\\ude00", }'])
def test_a_body_that_is_not_json_still_names_no_field(body) -> None:
    with pytest.raises(APIError) as refused:
        decode_json(body, COMPLETION_BODY)
    assert refused.value.param is None and "not valid JSON" in refused.value.message


def test_a_lone_surrogate_over_http_is_a_400_naming_its_field(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for shape, body, param in LONE:
            if shape != "embed":
                body = body.replace(b"{", b'{"model": "tiny", "max_tokens": 2, ', 1)
            r = http.post(ROUTES[shape], content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
            assert r.headers["x-request-id"]
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "\U0001f600", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


# Between the versions of a drain-mode swap (the old one retired, the next one loading) the model is in no
# model_info() entry, and the router answered its requests 404 "does not exist" (and /v1/models/<it> 404),
# though it is still served: docs/serving.md promises a 503 + Retry-After there. Now it is that 503.
def test_a_model_between_versions_of_a_drain_swap_is_a_503_to_retry_not_a_404(tiny_chat_model, monkeypatch) -> None:
    app = create_app([ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS),
                      ModelSpec(str(tiny_chat_model), "other", TINY_OPTIONS)])
    body = {"prompt": "hi", "max_tokens": 2}
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        engine = live.engine
        release = hold_swap_loads(monkeypatch)
        assert engine.loop is not None
        swap = asyncio.run_coroutine_threadsafe(
            engine.swap_model(str(tiny_chat_model), name="tiny", mode="drain", **TINY_OPTIONS), engine.loop)
        try:
            deadline = time.monotonic() + 30
            while any(info.name == "tiny" for info in engine.model_info()):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            for r in (http.post("/v1/completions", json={"model": "tiny", **body}),
                      http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]}),
                      http.get("/v1/models/tiny")):
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1" and r.headers["x-request-id"]
                assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("unavailable", "model")
            assert http.post("/v1/completions", json={"model": "gone", **body}).status_code == 404
            assert http.post("/v1/completions", json={"model": "other", **body}).status_code == 200
        finally:
            release.set()
        swap.result(60)
        assert http.post("/v1/completions", json={"model": "tiny", **body}).status_code == 200
        assert http.get("/v1/models/tiny").status_code == 200
