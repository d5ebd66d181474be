"""A stranger's first hour as an operator (stranger33): what the HTTP side says during a model swap."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from asyncinfer import swaps
from asyncinfer.server import ModelSpec, create_app

from .conftest import TINY_OPTIONS, LiveServer


# While a drain-mode swap loads the default model's next version, a request naming no model is a 503 whose message
# said "retry shortly, or name a model." On a server with one generator (asyncinfer serve with --embedding-model, the
# usual deployment) there is no model to name: the embedding model is a 400 on this route, and the default model's own
# name is the same 503. The hint now names the generators that would answer, and is left out where there are none.
@pytest.mark.parametrize("other", [False, True])
def test_the_503_of_a_drain_swap_names_only_models_that_would_answer(tiny_chat_model, monkeypatch, other) -> None:
    release = threading.Event()
    real_load = swaps.load

    def held_load(*args, **kwargs):
        assert release.wait(60)
        return real_load(*args, **kwargs)

    specs = [ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS)]
    if other:
        specs.append(ModelSpec(str(tiny_chat_model), "other", TINY_OPTIONS))
    app = create_app(specs)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        engine = live.engine
        monkeypatch.setattr(swaps, "load", held_load)
        assert engine.loop is not None
        swap = asyncio.run_coroutine_threadsafe(
            engine.swap_model(str(tiny_chat_model), name="tiny", mode="drain", **TINY_OPTIONS), engine.loop
        )
        try:
            deadline = time.monotonic() + 30
            while any(info.name == "tiny" for info in engine.model_info()):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            named = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        finally:
            release.set()
        swap.result(60)
    assert r.status_code == named.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    message = r.json()["error"]["message"]
    assert "between versions" in message and "name a model" not in message  # was: "..., or name a model."
    if other:
        assert message.endswith("retry shortly, or name another generator: `other`."), message
    else:
        assert message.endswith("retry shortly."), message
