"""``max_requests_per_tenant`` on a server without API keys: calls with neither tenant nor key share one count, and
their 429 says so; it said "This API key (which has no tenant) has 1 request in flight" to a caller who had sent no
key, on a server that takes none."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, create_app
from tests.server.conftest import TINY_OPTIONS, LiveServer

LONG = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
SHORT = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def no_keys(tiny_models):
    settings = ServerSettings(max_requests_per_tenant=1)
    options = dict(TINY_OPTIONS, max_num_seqs=1, max_waiting_requests=3)
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", options), settings)) as live:
        yield live


def test_calls_without_tenant_or_key_are_told_they_share_one_count(no_keys) -> None:
    done: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=no_keys.url, timeout=120) as http:
            done.append(http.post("/v1/completions", json=LONG).status_code)

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 30
    while no_keys.engine.num_unfinished_requests < 1:
        assert time.monotonic() < deadline and not done, "the first request neither ran nor was refused"
        time.sleep(0.002)
    with httpx.Client(base_url=no_keys.url, timeout=120) as http:
        refused = http.post("/v1/completions", json={**SHORT, "n": 1})
    thread.join(120)
    assert done == [200]
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"] == {
        "message": "Calls without a tenant or an API key, which share one count, have 1 request in flight, the most "
                   "this server allows one tenant (max_requests_per_tenant=1): retry when one has ended.",
        "type": "rate_limit_error", "param": None, "code": "tenant_requests_exceeded"}
    no_keys.wait_idle(60)
