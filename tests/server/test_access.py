"""Who gets in: API keys on /v1 and /metrics (not /health), bounded bodies, per-tenant prefix caches."""

from __future__ import annotations

import httpx
import openai
import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.schedulers import FIFOScheduler
from asyncinfer.server import ModelSpec, ServerSettings, api_keys_from_env, create_app

from .conftest import TINY_OPTIONS, LiveServer

KEYS = ("key-one", "key-two")
PROMPT = list(range(10, 50))  # 40 tokens: two full 16-token blocks the prefix cache can keep
TEXT = {"model": "ids", "prompt": PROMPT, "max_tokens": 2}


@pytest.fixture(scope="module")
def locked(tiny_models):
    settings = ServerSettings(api_keys=KEYS, max_body_bytes=4096, cache_isolation="api-key")
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live:
        yield live


def as_key(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


def prefix_hits(live: LiveServer) -> int:
    return live.engine.kv_stats("ids").prefix_hits


def test_keys_guard_every_v1_route_and_metrics_but_not_health(locked) -> None:
    with httpx.Client(base_url=locked.url) as http:
        for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
                             ("GET", "/v1/models"), ("GET", "/v1/models/ids"), ("GET", "/metrics")]:
            for key, code in [(None, None), ("wrong", "invalid_api_key"), ("key-one-", "invalid_api_key")]:
                r = http.request(method, path, headers=as_key(key), json=TEXT)
                assert r.status_code == 401, (path, key)
                error = r.json()["error"]
                assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, None)
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/metrics", headers=as_key("key-two")).status_code == 200
        assert http.post("/v1/completions", headers={"authorization": "Basic key-one"}, json=TEXT).status_code == 401


def test_the_openai_client_with_a_right_and_a_wrong_key(locked) -> None:
    with openai.OpenAI(base_url=locked.url + "/v1", api_key="key-two", max_retries=0) as good:
        assert good.completions.create(**TEXT).usage.prompt_tokens == len(PROMPT)
    with openai.OpenAI(base_url=locked.url + "/v1", api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"


def test_a_body_over_the_limit_is_a_413_read_or_not(locked) -> None:
    big = {**TEXT, "prompt": "x" * 5000}
    with httpx.Client(base_url=locked.url, headers=as_key("key-one")) as http:
        r = http.post("/v1/completions", json=big)  # Content-Length says it: refused unread
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunked = http.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 5000, b'"}']))
        assert chunked.status_code == 413  # no Content-Length: refused once 4096 bytes were read
        assert http.post("/v1/completions", json=TEXT).status_code == 200
        nobody = httpx.post(locked.url + "/v1/completions", json=big)
        assert nobody.status_code == 401  # the key is checked before any body is read


def test_api_key_isolation_keeps_prefix_caches_apart(locked) -> None:
    body = {**TEXT, "prompt": list(range(100, 140))}  # a prompt no other test sent
    with httpx.Client(base_url=locked.url) as http:
        def hits_of(key: str) -> int:
            before = prefix_hits(locked)
            assert http.post("/v1/completions", headers=as_key(key), json=body).status_code == 200
            return prefix_hits(locked) - before

        hits_of("key-one")
        assert hits_of("key-one") == 32  # the same tenant reuses its two cached blocks
        assert hits_of("key-two") == 0  # another tenant never reads them
        assert hits_of("key-two") == 32


def test_header_isolation_and_the_shared_default(tiny_models, server) -> None:
    settings = ServerSettings(cache_isolation="header", tenant_header="X-Tenant")
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live, \
            httpx.Client(base_url=live.url) as http:
        def hits_of(tenant: str) -> int:
            before = prefix_hits(live)
            assert http.post("/v1/completions", headers={"x-tenant": tenant}, json=TEXT).status_code == 200
            return prefix_hits(live) - before

        hits_of("acme")
        assert (hits_of("acme"), hits_of("globex")) == (32, 0)
    # Without isolation (the shared server's default), two users share the cached prefix.
    with httpx.Client(base_url=server.url) as http:
        before = prefix_hits(server)
        prompt = list(range(60, 100))
        for user in ("alice", "bob"):
            assert http.post("/v1/completions", json={**TEXT, "prompt": prompt, "user": user}).status_code == 200
        assert prefix_hits(server) - before == 32


def test_keys_from_the_environment_and_settings_checks() -> None:
    assert api_keys_from_env({"ASYNCINFER_API_KEY": " a, b ,,"}) == ("a", "b")
    assert api_keys_from_env({}) == ()
    with pytest.raises(InvalidParameterError, match="cache_isolation"):
        ServerSettings(cache_isolation="api-key")  # no keys to tell tenants apart
    with pytest.raises(InvalidParameterError, match="api_keys"):
        ServerSettings(api_keys="one-key")
    with pytest.raises(InvalidParameterError, match="max_body_bytes"):
        ServerSettings(max_body_bytes=10)


class RecordingScheduler(FIFOScheduler):
    """FIFO that remembers the id and priority of every request it is given."""

    seen: list[tuple[str, int]] = []

    def add_request(self, request):
        RecordingScheduler.seen.append((request.request_id, request.priority))
        super().add_request(request)


def test_user_and_priority_reach_the_scheduler(tiny_models) -> None:
    settings = ServerSettings(user_priorities={"vip": -5})
    options = {**TINY_OPTIONS, "scheduler": RecordingScheduler}
    RecordingScheduler.seen.clear()
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", options), settings)) as live:
        for extra in ({"user": "vip"}, {"user": "bob"}, {"user": "vip", "priority": 3}, {"user": "a/b"}, {}):
            assert httpx.post(live.url + "/v1/completions", json={**TEXT, **extra}).status_code == 200
    seen = [(rid.split("/cmpl-")[0] if "/cmpl-" in rid else None, prio) for rid, prio in RecordingScheduler.seen
            if rid != "warm-up"]
    # The user is the request id's tenant prefix (the convention of examples/custom_scheduler.py).
    assert seen == [("vip", -5), ("bob", 0), ("vip", 3), ("a%2Fb", 0), (None, 0)]
