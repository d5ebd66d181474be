"""stranger65: over HTTP a drain-mode swap's requests are promised a 503 (come back) from the call until the new
version serves (docs/model_swaps.md), but a request sent while the swap checked that the new model fits (before the
drain began) saw the old version still current, waited on the paused admission, and was held for the whole swap
(2.95 s, then a 200). No version serves from the call on now; a swap refused at its check gives the old one back."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from asyncinfer import ConfigurationError, swaps
from asyncinfer.server import create_app
from asyncinfer.server.settings import ModelSpec

from .conftest import TINY_OPTIONS, LiveServer

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def hold_checks(monkeypatch, refuse: bool = False) -> tuple[threading.Event, threading.Event]:
    """Hold every swap's fit check until ``release`` is set (``entered`` is set once one waits); ``refuse``: the
    check then refuses the swap, as one of a model that does not fit."""
    entered, release = threading.Event(), threading.Event()
    real = swaps.generator_shortfall

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        if refuse:
            raise ConfigurationError("the model does not fit (held test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(swaps, "generator_shortfall", held)
    return entered, release


def test_a_request_sent_during_a_drain_swaps_checks_is_a_503_at_once(tiny_chat_model, monkeypatch) -> None:
    app = create_app([ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS)])
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        engine = live.engine
        entered, release = hold_checks(monkeypatch)
        swap = asyncio.run_coroutine_threadsafe(
            engine.swap_model(str(tiny_chat_model), name="tiny", mode="drain", **TINY_OPTIONS), engine.loop)
        try:
            assert entered.wait(30)
            started = time.monotonic()
            r = http.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and time.monotonic() - started < 5, r.text
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "unavailable"
            # pass73: the models routes follow (they listed it and answered 200 while its completions were 503s)
            assert http.get("/v1/models").json()["data"] == []
            card = http.get("/v1/models/tiny")
            assert card.status_code == 503 and card.json()["error"]["code"] == "unavailable", card.text
        finally:
            release.set()
        swap.result(60)
        assert http.post("/v1/completions", json=BODY).status_code == 200


def test_a_drain_swap_refused_at_its_checks_leaves_the_old_version_serving(tiny_chat_model, monkeypatch) -> None:
    app = create_app([ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS)])
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        engine = live.engine
        before = [i.version_id for i in engine.model_info()]
        entered, release = hold_checks(monkeypatch, refuse=True)
        swap = asyncio.run_coroutine_threadsafe(
            engine.swap_model(str(tiny_chat_model), name="tiny", mode="drain", **TINY_OPTIONS), engine.loop)
        assert entered.wait(30)
        release.set()
        try:
            swap.result(60)
            raise AssertionError("the swap was not refused")
        except ConfigurationError:
            pass
        assert http.post("/v1/completions", json=BODY).status_code == 200
        assert [i.version_id for i in engine.model_info()] == before


async def test_a_close_during_a_drain_swaps_checks_gives_the_model_its_version_back(tiny_chat_model,
                                                                                    monkeypatch) -> None:
    """pass73: aclose() during the checks refused the drain before it began, but the model was left with no version:
    after the close kv_stats() and its tokenizer said a swap was loading, where a plain close keeps them working."""
    from asyncinfer import AsyncEngine, EngineClosedError

    engine = AsyncEngine.from_pretrained(tiny_chat_model, **TINY_OPTIONS)
    await engine.start()
    entered, release = hold_checks(monkeypatch)
    swap = asyncio.ensure_future(engine.swap_model(str(tiny_chat_model), mode="drain", **TINY_OPTIONS))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(engine.aclose())
    await asyncio.sleep(0.1)
    release.set()
    try:
        await swap
        raise AssertionError("the swap was not refused")
    except EngineClosedError:
        pass
    await closing
    assert engine.kv_stats() is not None and engine.get_tokenizer() is not None
