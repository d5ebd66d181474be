"""One request's costly HTTP work never holds the serving loop: a long logprobs answer is built, and a
large body parsed, in a worker thread, while the loop answers everyone else (``/health`` here).

The costly step is made to wait, in whatever thread runs it, until ``/health`` has been answered: in a
worker thread ``/health`` answers at once; on the loop it could not answer at all (the loop would be
the one waiting), so these tests fail the moment that work runs on the loop again.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest

from asyncinfer.server import router
from asyncinfer.server.responses import Reply

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WAIT = 10.0  # how long the costly step waits for /health to be answered; /health gets half of it


def loop_thread(server) -> int:
    async def ident() -> int:
        return threading.get_ident()

    return server.call(ident())


def answered_while_held(server, monkeypatch, owner, name: str, send, wrap=None) -> tuple[httpx.Response, set[int]]:
    """Hold ``owner.name`` (a function or method of the HTTP layer) in whatever thread first calls it until
    ``/health`` has answered; ``send()`` makes the request that calls it. Returns that request's answer and
    the threads ``owner.name`` ran in. ``wrap(real, hold)``: what stands in for ``owner.name`` when the hold
    belongs elsewhere than before the call (default: ``hold()``, then ``real``)."""
    real = getattr(owner, name)
    started, health_done = threading.Event(), threading.Event()
    threads: set[int] = set()

    def hold() -> None:
        threads.add(threading.get_ident())
        started.set()
        health_done.wait(WAIT)

    def held(*args, **kwargs):
        hold()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held if wrap is None else wrap(real, hold))
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send)
        try:
            assert started.wait(60), "the request never reached the step under test"
            try:
                health = httpx.get(server.url + "/health", timeout=WAIT / 2)
            except httpx.TimeoutException:
                pytest.fail("/health did not answer while one request's work was under way: it ran on the loop")
        finally:
            health_done.set()
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        return answer.result(120), threads


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["chat", "text"])
def test_a_logprobs_answer_is_built_off_the_loop(server, monkeypatch, route, stream) -> None:
    fields = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}
    if route == "chat":
        path, body = "/v1/chat/completions", {**fields, "messages": MESSAGES, "logprobs": True, "top_logprobs": 5}
    else:
        path, body = "/v1/completions", {**fields, "prompt": "The quick brown fox", "logprobs": 5}

    def send() -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=120)

    answer, threads = answered_while_held(server, monkeypatch, Reply, "token_text", send)
    assert answer.status_code == 200, answer.text
    assert loop_thread(server) not in threads
    if stream:
        events = [line.removeprefix("data: ") for line in answer.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [msgspec.json.decode(e)["choices"] for e in events[:-1]]
        logprobs = [c[0]["logprobs"] for c in chunks if c and c[0]["logprobs"]]
        count = sum(len(lp["content"]) if route == "chat" else len(lp["tokens"]) for lp in logprobs)
    else:
        logprobs = answer.json()["choices"][0]["logprobs"]
        count = len(logprobs["content"]) if route == "chat" else len(logprobs["tokens"])
    assert count == 8


PAD = {"prompt_cache_key": "x" * 6000}  # an ignored field: a body past the on-loop size, answered 200


@pytest.mark.parametrize("step", ["decode_json", "parse_chat"])
def test_a_large_body_is_decoded_and_checked_off_the_loop(server, monkeypatch, step) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **PAD}
    assert len(msgspec.json.encode(body)) > router.OFF_LOOP_CHARS

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)

    answer, threads = answered_while_held(server, monkeypatch, router, step, send)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 2
    assert loop_thread(server) not in threads


def test_a_small_body_is_read_on_the_loop_and_the_limits_hold(server, monkeypatch) -> None:
    """No thread hop for an ordinary body; the nesting limit holds on either side of the size threshold."""
    threads: set[int] = set()
    real = router.parse_chat

    def recorded(body):
        threads.add(threading.get_ident())
        return real(body)

    monkeypatch.setattr(router, "parse_chat", recorded)
    small = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=small, timeout=60).status_code == 200
    assert threads == {loop_thread(server)}
    nested = {"a": None}
    for _ in range(40):
        nested = {"a": nested}
    for pad in ({}, PAD):
        r = httpx.post(server.url + "/v1/chat/completions", json={**small, **pad, "metadata": nested}, timeout=60)
        assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"]
        assert (len(r.request.content) > router.OFF_LOOP_CHARS) == bool(pad)
