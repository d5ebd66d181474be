"""Who gets in, and as whom: API keys on /v1, an operator's key on /metrics (never a tenant's), /health open,
bounded bodies, per-tenant prefix caches, and tenants and priorities from the deployment's policy only."""

from __future__ import annotations

import json
from typing import ClassVar

import httpx
import openai
import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.schedulers import FIFOScheduler
from asyncinfer.server import (
    ModelSpec,
    ServerSettings,
    Tenant,
    api_keys_from_env,
    create_app,
    metrics_keys_from_env,
)

from .conftest import KEYS, TINY_OPTIONS, LiveServer

OPS = "ops-key"  # the operator's, for /metrics
PROMPT = list(range(10, 50))  # 40 tokens: two full 16-token blocks the prefix cache can keep
TEXT = {"model": "ids", "prompt": PROMPT, "max_tokens": 2}


@pytest.fixture(scope="module")
def locked(tiny_models):
    settings = ServerSettings(api_keys=KEYS, max_body_bytes=4096, cache_isolation="api-key", metrics_keys=(OPS,))
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
                assert r.headers["x-request-id"]
        assert http.get("/health").json() == {"status": "ok"}
        assert http.post("/v1/completions", headers={"authorization": "Basic key-one"}, json=TEXT).status_code == 401
        assert http.get("/v1/models", headers=as_key(OPS)).status_code == 401  # the operator's key is for /metrics


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/nope", 404), ("GET", "/v1/", 404), ("GET", "/v1", 404), ("DELETE", "/v1/files/x", 404),
    ("GET", "/v1/chat/completions", 405), ("POST", "/v1/models", 405), ("PUT", "/v1/models/ids", 405),
    ("POST", "/v1/chat/completions/", 404), ("POST", "/v1/completions/", 404),
])
def test_without_a_key_no_v1_url_says_whether_it_exists(locked, method, path, status) -> None:
    """An unknown /v1 URL or a wrong method there is a 401 first: no route discovery without a key."""
    with httpx.Client(base_url=locked.url) as http:
        for key, code in [(None, None), ("wrong", "invalid_api_key"), (OPS, "invalid_api_key")]:
            r = http.request(method, path, headers=as_key(key), json=TEXT)
            assert r.status_code == 401, (path, key, r.text)
            assert r.json()["error"]["code"] == code and r.headers["x-request-id"] and "allow" not in r.headers
        r = http.request(method, path, headers=as_key("key-one"), json=TEXT)
        assert r.status_code == status and r.json()["error"]["code"] in ("unknown_url", "method_not_allowed")
        assert http.get("/nope").status_code == 404  # outside /v1, as without keys
        assert http.post("/health").status_code == 405
        for slashed in ("/health/", "/metrics/"):  # no redirect (its Location built from Host) anywhere
            r = http.get(slashed, headers={"host": "evil.example"})
            assert r.status_code == 404 and "location" not in r.headers and r.json()["error"]["code"] == "unknown_url"


def test_a_tenants_key_never_reads_metrics_the_operators_does(locked) -> None:
    """/metrics shows every tenant's figures (their prefix-cache hits among them): a tenant's key gets a 401."""
    body = {**TEXT, "prompt": list(range(200, 240))}
    with httpx.Client(base_url=locked.url) as http:
        for _ in range(2):  # key-two's second request hits its own cached prefix
            assert http.post("/v1/completions", headers=as_key("key-two"), json=body).status_code == 200
        for key in KEYS:
            r = http.get("/metrics", headers=as_key(key))
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert "asyncinfer_prefix_cache_hit_tokens_total" not in r.text
        r = http.get("/metrics", headers=as_key(OPS))
        assert r.status_code == 200 and "asyncinfer_prefix_cache_hit_tokens_total" in r.text


def test_the_metrics_401_names_the_key_it_needs_and_no_key(locked) -> None:
    with httpx.Client(base_url=locked.url) as http:
        for key, code in [(None, None), ("wrong-guess", "invalid_api_key"), ("key-one", "invalid_api_key")]:
            r = http.get("/metrics", headers=as_key(key))
            assert r.status_code == 401 and r.headers["x-request-id"]
            error = r.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, None)
            message = error["message"]
            assert "/metrics" in message and "metrics key" in message and "ServerSettings.metrics_keys" in message
            assert "--metrics-key" in message and "ASYNCINFER_METRICS_KEY" in message
            assert ("key provided is not a metrics key" in message) == (key is not None)
            for secret in (*KEYS, OPS, "wrong-guess"):
                assert secret not in message


def test_metrics_are_off_on_a_keyed_server_without_an_operators_key(tiny_models) -> None:
    settings = ServerSettings(api_keys=KEYS)
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live, \
            httpx.Client(base_url=live.url) as http:
        for key in (None, *KEYS):
            r = http.get("/metrics", headers=as_key(key))
            assert r.status_code == 403 and r.headers["x-request-id"]
            assert r.json()["error"]["code"] == "metrics_key_required"
            assert "metrics_keys" in r.json()["error"]["message"]
    with pytest.raises(InvalidParameterError, match="metrics_keys"):
        ServerSettings(api_keys=KEYS, metrics_keys=("key-one",))  # a tenant's key may not double as the operator's
    with pytest.raises(InvalidParameterError, match="metrics_keys"):
        ServerSettings(tenants={"sk-t": Tenant("t")}, metrics_keys=("sk-t",))


def test_the_openai_client_with_a_right_and_a_wrong_key(locked) -> None:
    with openai.OpenAI(base_url=locked.url + "/v1", api_key="key-two", max_retries=0) as good:
        assert good.completions.create(**TEXT).usage.prompt_tokens == len(PROMPT)
    with (openai.OpenAI(base_url=locked.url + "/v1", api_key="sk-wrong", max_retries=0) as bad,
          pytest.raises(openai.AuthenticationError) as err):
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
    assert api_keys_from_env({"ASYNCINFER_API_KEY": " a, b "}) == ("a", "b")
    for gap in ("sk-x,,sk-y", "sk-x, ,sk-y", "sk-x,", ",sk-x"):  # an empty item: not the keys someone meant
        with pytest.raises(InvalidParameterError, match="empty item"):
            api_keys_from_env({"ASYNCINFER_API_KEY": gap})
    assert api_keys_from_env({}) == ()
    assert metrics_keys_from_env({"ASYNCINFER_METRICS_KEY": "ops"}) == ("ops",)
    for blank in ("", "  ", ",", " , ,"):  # set, but to no key: an error, never a server without keys
        with pytest.raises(InvalidParameterError, match="ASYNCINFER_API_KEY"):
            api_keys_from_env({"ASYNCINFER_API_KEY": blank})
        with pytest.raises(InvalidParameterError, match="ASYNCINFER_METRICS_KEY"):
            metrics_keys_from_env({"ASYNCINFER_METRICS_KEY": blank})
    for keys in (("",), ("a", ""), (" a",)):
        with pytest.raises(InvalidParameterError, match="api_keys"):
            ServerSettings(api_keys=keys)
    with pytest.raises(InvalidParameterError, match="cache_isolation"):
        ServerSettings(cache_isolation="api-key")  # no keys to tell tenants apart
    with pytest.raises(InvalidParameterError, match="api_keys"):
        ServerSettings(api_keys="one-key")
    with pytest.raises(InvalidParameterError, match="max_body_bytes"):
        ServerSettings(max_body_bytes=10)
    with pytest.raises(InvalidParameterError, match="tenant_from"):
        ServerSettings(tenant_from="body")
    with pytest.raises(InvalidParameterError, match="tenants"):
        ServerSettings(tenants={"sk-a": "acme"})
    with pytest.raises(InvalidParameterError, match="name"):
        Tenant("x" * 129)
    with pytest.raises(InvalidParameterError, match="priority_header"):
        ServerSettings(priority_header="Authorization")
    for name, value in (("header_timeout", 0), ("body_timeout", float("inf")), ("max_connections", 0)):
        with pytest.raises(InvalidParameterError, match=name):
            ServerSettings(**{name: value})


def test_a_blank_key_variable_stops_serve_before_anything_loads(monkeypatch, capsys) -> None:
    from asyncinfer import cli

    for value in (" ", "sk-x,,sk-y"):
        monkeypatch.setenv("ASYNCINFER_API_KEY", value)
        assert cli.main(["serve", "/no/such/model"]) == 2
        err = capsys.readouterr().err
        assert "ASYNCINFER_API_KEY" in err and "does not exist" not in err  # refused before the model is looked at
        assert "sk-x" not in err  # no key is shown


class RecordingScheduler(FIFOScheduler):
    """FIFO that remembers the tenant (the request id's prefix) and priority of every request it is given."""

    seen: ClassVar[list[tuple[str | None, int]]] = []

    def add_request(self, request):
        rid = request.request_id
        RecordingScheduler.seen.append((rid.rsplit("/", 1)[0] if "/" in rid else None, request.priority))
        super().add_request(request)


def recorded(settings: ServerSettings, tiny_models, calls) -> list:
    """What the scheduler saw for each (headers, body changes) call; a refused call records its 400's param."""
    options = {**TINY_OPTIONS, "scheduler": RecordingScheduler}
    got = []
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", options), settings)) as live, \
            httpx.Client(base_url=live.url) as http:
        for headers, extra in calls:
            RecordingScheduler.seen.clear()
            r = http.post("/v1/completions", headers=headers, json={**TEXT, **extra})
            if r.status_code == 400:
                got.append(("400", r.json()["error"]["param"]))
            else:
                assert r.status_code == 200, r.text
                (one,) = RecordingScheduler.seen
                got.append(one)
    return got


def test_by_default_a_caller_chooses_neither_its_tenant_nor_its_priority(tiny_models) -> None:
    """The key's Tenant decides; the body's ``user`` changes nothing, its ``priority`` is refused, and
    headers are not read."""
    tenants = {"sk-acme": Tenant("acme", 2), "sk-vip": Tenant("vip", -5)}
    settings = ServerSettings(api_keys=("sk-plain",), tenants=tenants)
    acme, vip, plain = as_key("sk-acme"), as_key("sk-vip"), as_key("sk-plain")
    calls = [(acme, {}), (vip, {}), (plain, {}), (acme, {"user": "vip"}), (acme, {"priority": -10}),
             ({**acme, "x-tenant-id": "vip", "x-priority": "-9"}, {}), (plain, {"user": "vip"})]
    assert recorded(settings, tiny_models, calls) == [
        ("acme", 2), ("vip", -5), (None, 0), ("acme", 2), ("400", "priority"), ("acme", 2), (None, 0)]


def test_a_trusted_header_names_the_tenant_and_the_priority(tiny_models) -> None:
    settings = ServerSettings(tenant_from="header", tenant_header="X-Team", priority_header="X-Priority",
                              tenant_priorities={"vip": -5})
    calls = [({"x-team": "vip"}, {}), ({"x-team": "vip", "x-priority": "7"}, {}), ({"x-team": "bob"}, {}),
             ({}, {}), ({"x-team": "bob"}, {"user": "vip"}), ({"x-team": "a/b"}, {}),
             ({"x-team": "vip", "x-priority": "high"}, {}), ({}, {"priority": 1})]
    got = recorded(settings, tiny_models, calls)
    assert got[:6] == [("vip", -5), ("vip", 7), ("bob", 0), (None, 0), ("bob", 0), ("a%2Fb", 0)]
    assert got[6:] == [("400", None), ("400", "priority")]


def test_trusted_callers_name_themselves_and_distinct_users_never_share_an_id(tiny_models) -> None:
    settings = ServerSettings(tenant_from="request", tenant_priorities={"vip": -5})
    long = "u" * 128
    calls = [({}, {"user": "vip"}), ({}, {"user": "bob"}), ({}, {"user": "vip", "priority": 3}), ({}, {"user": "a/b"}),
             ({}, {"user": "a%2Fb"}), ({}, {}), ({}, {"user": long}), ({}, {"user": "%/" * 64}),
             ({}, {"user": long + "u"})]
    got = recorded(settings, tiny_models, calls)
    assert got[:6] == [("vip", -5), ("bob", 0), ("vip", 3), ("a%2Fb", 0), ("a%252Fb", 0), (None, 0)]
    assert got[6] == (long, 0) and got[7] == ("%25%2F" * 64, 0)  # the longest users fit the engine's id limit
    assert got[8] == ("400", "user")  # too long: a 400 naming `user`, not the engine's request_id


def test_user_priorities_is_the_deprecated_name_of_tenant_priorities() -> None:
    import warnings

    from asyncinfer.server.settings import ServerSettings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = ServerSettings(user_priorities={"batch": 5}, tenant_priorities={"web": 0})
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "tenant_priorities" in str(caught[0].message)
    assert dict(settings.tenant_priorities) == {"batch": 5, "web": 0}
    assert settings == ServerSettings(tenant_priorities={"batch": 5, "web": 0})


@pytest.mark.parametrize("copies", [
    [("authorization", "Bearer key-one"), ("authorization", "Bearer wrong")],
    [("authorization", "Bearer wrong"), ("authorization", "Bearer key-one")],
    [("authorization", "Bearer key-one"), ("x-team", "vip"), ("X-Team", "bob")],
    [("authorization", "Bearer key-one"), ("x-priority", "-9"), ("x-priority", "5")],
    [("authorization", "Bearer key-one"), ("content-type", "application/json"), ("content-type", "text/plain")],
])
def test_a_header_a_decision_reads_given_twice_is_a_400_naming_it(trusting, copies) -> None:
    """Whichever copy won, a client could pre-empt the copy its proxy appends: neither wins."""
    name = copies[-1][0].lower()
    with httpx.Client(base_url=trusting.url) as http:
        for path in ("/v1/completions", "/v1/nope"):
            r = http.post(path, headers=copies, content=json.dumps(TEXT))
            assert r.status_code == (400 if path == "/v1/completions" or name == "authorization" else 404), r.text
            if r.status_code == 400:
                error = r.json()["error"]
                assert (error["type"], error["code"]) == ("invalid_request_error", "duplicate_header")
                assert f"`{name}`" in error["message"] and r.headers["x-request-id"]
        assert http.post("/v1/completions", headers=as_key("key-one"), json=TEXT).status_code == 200


def test_a_proxys_tenant_and_priority_headers_must_be_well_formed(trusting) -> None:
    key = as_key("key-one")
    with httpx.Client(base_url=trusting.url) as http:
        for headers, code in [({"x-team": ""}, "invalid_tenant"), ({"x-team": "t" * 129}, "invalid_tenant"),
                              *(({"x-priority": bad}, "invalid_priority")
                                for bad in ("1_000", "+3", "1 000", "", "٣".encode(), "1.0", "--1", "9" * 5000))]:
            r = http.post("/v1/completions", headers={**key, **headers}, json=TEXT)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, (headers, r.text)
        for good in ({"x-team": "t" * 128}, {"x-priority": "-12"}, {"x-priority": "007"}, {}):
            assert http.post("/v1/completions", headers={**key, **good}, json=TEXT).status_code == 200, good
