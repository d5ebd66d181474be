"""``max_requests_per_tenant`` for a key without a tenant: the key counts as a tenant of its own, and its 429 says
so ("This API key (which has no tenant)"), where it said "This tenant" of a key that has none."""

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


@pytest.fixture(scope="module")
def plain_keys(tiny_models):
    settings = ServerSettings(api_keys=(KEY,), max_requests_per_tenant=1)
    options = dict(TINY_OPTIONS, max_num_seqs=1, max_waiting_requests=3)
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", options), settings)) as live:
        yield live


def test_a_key_without_a_tenant_is_told_it_is_the_key(plain_keys) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    done: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=plain_keys.url, timeout=120) as http:
            done.append(http.post("/v1/completions", json=LONG, headers=headers).status_code)

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 30
    while plain_keys.engine.num_unfinished_requests < 1:
        assert time.monotonic() < deadline and not done, "the first request neither ran nor was refused"
        time.sleep(0.002)
    with httpx.Client(base_url=plain_keys.url, timeout=120) as http:
        refused = http.post("/v1/completions", json=SHORT, headers=headers)
    thread.join(120)
    assert done == [200]
    assert refused.status_code == 429 and refused.headers["x-request-id"]
    assert refused.json()["error"] == {
        "message": "This API key (which has no tenant) has 1 request in flight, the most this server allows one "
                   "tenant (max_requests_per_tenant=1): retry when one has ended.",
        "type": "rate_limit_error", "param": None, "code": "tenant_requests_exceeded"}
    plain_keys.wait_idle(60)
