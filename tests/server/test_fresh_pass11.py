"""Adversarial pass 11 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from asyncinfer.core import EngineCore
from asyncinfer.server import ModelSpec, create_app

from .conftest import TINY_OPTIONS, LiveServer, held_drain_swap


# A text prompt sent to /v1/completions for a model loaded without a tokenizer was answered with the chat's message:
# "so chat messages cannot be rendered for it: send its prompt to /v1/completions as token ids" -- no chat was sent,
# and the route it points to is the one that refused it. The 400 now says what is wrong with the prompt.
@pytest.mark.parametrize("stream", [False, True])
def test_a_text_prompt_for_a_model_without_a_tokenizer_says_to_send_token_ids(server, stream) -> None:
    body = {"model": "ids", "prompt": "abc", "max_tokens": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["x-request-id"].startswith("cmpl-")
    assert r.json() == {
        "error": {
            "message": "This model was loaded without a tokenizer, so a text prompt cannot be encoded for it: send "
            "`prompt` as token ids (a list of integers, or a list of such lists).",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
    }


# A request that names no model is the engine's default generator's (the first loaded). Between the versions of a
# drain-mode swap of that model it is in no model_info() entry, and the router took the first generator it listed
# instead: the request was answered by another model (its reply and its `model` field another's), where one naming
# the default model is a 503 to retry. Now both are that 503; after the swap the default model answers again.
def test_a_request_naming_no_model_is_not_served_by_another_while_the_default_one_is_swapped(
    tiny_chat_model, monkeypatch
) -> None:
    app = create_app(
        [ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), ModelSpec(str(tiny_chat_model), "other", TINY_OPTIONS)]
    )
    chat = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()["model"] == "tiny"
        with held_drain_swap(live, tiny_chat_model, "tiny", monkeypatch):
            for stream in (False, True):
                for r in (
                    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream}),
                    http.post("/v1/chat/completions", json={**chat, "stream": stream}),
                ):
                    assert r.status_code == 503, r.text  # was 200, answered by "other"
                    assert r.headers["retry-after"] == "1" and r.headers["x-request-id"]
                    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("unavailable", "model")
            assert (
                http.post("/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 2}).status_code
                == 200
            )
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()["model"] == "tiny"


# A model being removed stays in model_info() ("draining") until its last request ends, but the engine takes no new
# request for it. /v1/models still listed it and /v1/models/<it> answered its card, while every request naming it was
# a 404: a client picking a model from the list was sent to one that is gone. Now it is left out of both at once.
def test_a_model_being_removed_is_not_listed_while_its_requests_are_refused(tiny_chat_model, monkeypatch) -> None:
    go = threading.Event()
    real_step = EngineCore.step

    def held_step(self):  # each step slow until the test has looked: the request stays in flight meanwhile
        go.wait(0.05)
        return real_step(self)

    app = create_app(
        [ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), ModelSpec(str(tiny_chat_model), "other", TINY_OPTIONS)]
    )
    long = {"model": "tiny", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}  # 20 s of steps
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        engine = live.engine
        assert engine.loop is not None
        monkeypatch.setattr(EngineCore, "step", held_step)
        try:
            held = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": long})
            held.start()
            deadline = time.monotonic() + 30
            while not engine.num_unfinished_requests:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            removal = asyncio.run_coroutine_threadsafe(engine.remove_model("tiny"), engine.loop)
            while ("tiny", "draining") not in [(info.name, info.state) for info in engine.model_info()]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert [card["id"] for card in http.get("/v1/models").json()["data"]] == ["other"]  # was other, tiny
            card = http.get("/v1/models/tiny")  # was a 200 with its card
            assert card.status_code == 404 and card.json()["error"]["code"] == "model_not_found"
            refused = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
            assert (
                refused.json()["error"]["message"]
                == card.json()["error"]["message"]
                == ("The model `tiny` does not exist. This server serves: `other`.")
            )
            assert not removal.done()
        finally:
            go.set()
        held.join(60)
        removal.result(60)


# An empty string to embed was answered 200 with a vector of nothing but the special tokens; OpenAI refuses it.
@pytest.mark.parametrize("given", ["", ["hello", ""], [""]])
def test_an_empty_string_to_embed_is_a_400_naming_input(server, given) -> None:
    answer = httpx.post(server.url + "/v1/embeddings", timeout=60, json={"model": "minilm", "input": given})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "input" and "empty string" in error["message"] and answer.headers["x-request-id"]
    fine = httpx.post(server.url + "/v1/embeddings", timeout=60, json={"model": "minilm", "input": ["hello", " "]})
    assert fine.status_code == 200 and len(fine.json()["data"]) == 2
