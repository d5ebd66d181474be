"""A client that goes away aborts its request: the engine stops decoding it and gets its KV blocks back."""

from __future__ import annotations

import json
import time

import httpx
import pytest

LONG = 480  # tokens the tiny model takes 0.3-1 s to decode (a fast or a slow machine), were it not aborted
#: How long a client waits for a whole answer before it gives up: well within LONG's time on the fastest machine seen
#: (1,300 tokens a second), so at most a fraction of LONG is decoded before the disconnect is noticed.
GIVE_UP_S = 0.05


def decoded(server) -> int:
    return server.engine.step_stats("tiny").decode_tokens


def held_blocks(server) -> int:
    return server.engine.kv_stats("tiny").used_blocks


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_the_blocks(server, route) -> None:
    server.wait_idle()
    before = decoded(server)
    body = {"model": "tiny", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    body |= chat if "chat" in route else {"prompt": "The quick brown fox"}
    with httpx.Client(base_url=server.url, timeout=30) as http, http.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        chunks = [json.loads(line.removeprefix("data: ")) for line, _ in zip(lines, range(4)) if line]
        assert chunks and held_blocks(server) > 0  # mid-stream: the request holds its KV blocks
    server.wait_idle()
    assert held_blocks(server) == 0
    assert decoded(server) - before < LONG // 2  # it stopped early: aborted, not finished


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server) -> None:
    server.wait_idle()
    before = decoded(server)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": LONG, "ignore_eos": True}
    with (httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=GIVE_UP_S)) as http,
          pytest.raises(httpx.ReadTimeout)):  # the client gives up and closes the connection
        http.post("/v1/completions", json=body)
    server.wait_idle()
    assert held_blocks(server) == 0
    assert decoded(server) - before < LONG // 2


def test_disconnect_of_a_several_prompt_request_aborts_them_all(server) -> None:
    server.wait_idle()
    before = decoded(server)
    body = {"model": "tiny", "prompt": ["one", "two", "three"], "n": 2, "max_tokens": LONG, "ignore_eos": True}
    with (httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=GIVE_UP_S)) as http,
          pytest.raises(httpx.ReadTimeout)):
        http.post("/v1/completions", json=body)
    server.wait_idle()
    assert decoded(server) - before < 3 * LONG  # half the six samples of LONG tokens each
