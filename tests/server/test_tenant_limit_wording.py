"""``max_requests_per_tenant``'s 429 names who was counted. Calls with neither tenant nor key, on a server without
API keys, share one count, and their 429 says so: it said "This API key (which has no tenant) has 1 request in
flight" to a caller who had sent no key, on a server that takes none. A key without a tenant counts as a tenant of
its own, and its 429 says so ("This API key (which has no tenant)"), where it said "This tenant" of a key that has
none."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, create_app
from tests.server.conftest import TINY_OPTIONS, LiveServer

KEY = "sk-plain"
LONG = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
SHORT = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


def serve(tiny_models, settings: ServerSettings) -> LiveServer:
    options = dict(TINY_OPTIONS, max_num_seqs=1, max_waiting_requests=3)
    return LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", options), settings))


@pytest.fixture(scope="module")
def no_keys(tiny_models):
    with serve(tiny_models, ServerSettings(max_requests_per_tenant=1)) as live:
        yield live


@pytest.fixture(scope="module")
def plain_keys(tiny_models):
    with serve(tiny_models, ServerSettings(api_keys=(KEY,), max_requests_per_tenant=1)) as live:
        yield live


def refused_beside_one_running(live: LiveServer, headers: dict[str, str]) -> httpx.Response:
    """The answer to a short call sent (with ``headers``) while a long one of the same caller runs; the long one
    must end with a 200."""
    done: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=live.url, timeout=120) as http:
            done.append(http.post("/v1/completions", json=LONG, headers=headers).status_code)

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 30
    while live.engine.num_unfinished_requests < 1:
        assert time.monotonic() < deadline and not done, "the first request neither ran nor was refused"
        time.sleep(0.002)
    with httpx.Client(base_url=live.url, timeout=120) as http:
        refused = http.post("/v1/completions", json=SHORT, headers=headers)
    thread.join(120)
    assert done == [200]
    live.wait_idle(60)
    return refused


def test_calls_without_tenant_or_key_are_told_they_share_one_count(no_keys) -> None:
    refused = refused_beside_one_running(no_keys, {})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"] == {
        "message": "Calls without a tenant or an API key, which share one count, have 1 request in flight, the most "
                   "this server allows one tenant (max_requests_per_tenant=1): retry when one has ended.",
        "type": "rate_limit_error", "param": None, "code": "tenant_requests_exceeded"}


def test_a_key_without_a_tenant_is_told_it_is_the_key(plain_keys) -> None:
    refused = refused_beside_one_running(plain_keys, {"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 429 and refused.headers["x-request-id"]
    assert refused.json()["error"] == {
        "message": "This API key (which has no tenant) has 1 request in flight, the most this server allows one "
                   "tenant (max_requests_per_tenant=1): retry when one has ended.",
        "type": "rate_limit_error", "param": None, "code": "tenant_requests_exceeded"}
