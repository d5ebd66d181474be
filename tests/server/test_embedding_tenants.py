"""``/v1/embeddings`` calls are batched by tenant: the router hands ``AsyncEngine.embed`` the call's tenant, the
one ``tenant_from`` names (else its API key's own group), so one key's flood of calls takes one text in every
round of the batches, as another key's single call does. The router passed no tenant: key A's 500 concurrent calls
of long texts held key B's one-text call for about 500 / 8 batches."""

from __future__ import annotations

import hashlib

import httpx

from asyncinfer.server import ModelSpec, ServerSettings, Tenant, create_app

from .conftest import LiveServer


def key_group(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()


def tenant_group(name: str) -> str:
    return "tenant:" + hashlib.sha256(name.encode()).hexdigest()


def tenants_seen(settings: ServerSettings, minilm_dir, calls) -> list:
    """The ``tenant`` the engine's ``embed`` got for each (headers, body changes) call; a refused call records
    its 400's param and code."""
    got: list = []
    with LiveServer(create_app(ModelSpec(str(minilm_dir), "minilm"), settings), settings) as live, \
            httpx.Client(base_url=live.url) as http:
        real = live.engine.embed

        async def spy(texts, *, model=None, tenant=None):
            got.append(tenant)
            return await real(texts, model=model, tenant=tenant)

        live.engine.embed = spy  # type: ignore[method-assign]
        for headers, extra in calls:
            r = http.post("/v1/embeddings", headers=headers, json={"model": "minilm", "input": "hello", **extra})
            if r.status_code == 400:
                got.append(("400", r.json()["error"]["param"], r.json()["error"]["code"]))
            else:
                assert r.status_code == 200, r.text
                assert len(r.json()["data"][0]["embedding"]) == 384
    return got


def test_each_key_is_its_own_group_and_a_keys_tenant_names_it(minilm_dir) -> None:
    """The brief's deployment (``--api-key A --api-key B --tenant-from api-key``): each key's calls are one group,
    named by the key's hash (never the key); a key's ``Tenant`` names its group; the body's ``user`` changes nothing."""
    settings = ServerSettings(api_keys=("sk-a", "sk-b"),
                              tenants={"sk-acme": Tenant("acme"), "sk-acme2": Tenant("acme")})
    a, b = {"authorization": "Bearer sk-a"}, {"authorization": "Bearer sk-b"}
    acme, acme2 = {"authorization": "Bearer sk-acme"}, {"authorization": "Bearer sk-acme2"}
    got = tenants_seen(settings, minilm_dir, [(a, {}), (b, {}), (a, {"user": "acme"}), (acme, {}), (acme2, {})])
    assert got == [key_group("sk-a"), key_group("sk-b"), key_group("sk-a"), tenant_group("acme"), tenant_group("acme")]
    assert key_group("sk-a") != key_group("sk-b") and all("sk-" not in name for name in got)


def test_without_keys_every_call_is_one_group(minilm_dir) -> None:
    assert tenants_seen(ServerSettings(), minilm_dir, [({}, {}), ({}, {"user": "bob"})]) == [None, None]


def test_a_trusted_header_or_body_names_the_tenant(minilm_dir) -> None:
    settings = ServerSettings(tenant_from="header", tenant_header="X-Team")
    calls = [({"x-team": "vip"}, {}), ({}, {}), ({"x-team": "bob"}, {"user": "vip"}), ({"x-team": ""}, {}),
             (httpx.Headers([("x-team", "vip"), ("x-team", "bob")]), {})]
    assert tenants_seen(settings, minilm_dir, calls) == [
        tenant_group("vip"), None, tenant_group("bob"), ("400", None, "invalid_tenant"), ("400", None, "duplicate_header")]
    settings = ServerSettings(tenant_from="request")
    calls = [({}, {"user": "bob"}), ({}, {}), ({"x-tenant-id": "vip"}, {"user": "a/b"}), ({}, {"user": "u" * 129}),
             ({}, {"user": "a\nb"})]
    assert tenants_seen(settings, minilm_dir, calls) == [
        tenant_group("bob"), None, tenant_group("a/b"), ("400", "user", None), ("400", "user", None)]


def test_a_tenant_named_as_a_keys_group_is_not_in_it(minilm_dir) -> None:
    """A tenant whose name is ``key:<sha256 of a key>`` (a trusted header's or body's, or a key's ``Tenant``) is
    not batched with that key's calls: tenants and keys are named in two spaces. Names went to the engine as they
    were, so such a tenant joined the key's group and took its turns."""
    posing = key_group("sk-a")
    settings = ServerSettings(api_keys=("sk-a",), tenant_from="header", tenant_header="X-Team")
    a = {"authorization": "Bearer sk-a"}
    got = tenants_seen(settings, minilm_dir, [(a, {}), ({**a, "x-team": posing}, {})])
    assert got == [key_group("sk-a"), tenant_group(posing)] and got[0] != got[1]
    settings = ServerSettings(tenant_from="request")
    assert tenants_seen(settings, minilm_dir, [({}, {"user": posing})]) == [tenant_group(posing)]


def test_a_generation_call_names_its_group_as_an_embedding_call_does(tiny_models) -> None:
    """``engine.generate``/``stream`` get the call's group as ``tenant`` (its grammar compile takes that group's
    turns): with the server's default ``cache_isolation="off"`` no call had a salt, so every caller's structured
    requests took the compile places as they came, and one key's costly specs held them all."""
    from .conftest import TINY_OPTIONS

    settings = ServerSettings(api_keys=("sk-a", "sk-b"), tenants={"sk-acme": Tenant("acme")})
    got: list = []
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings),
                    settings) as live, httpx.Client(base_url=live.url) as http:
        real_generate, real_stream = live.engine.generate, live.engine.stream

        async def generate(*args, **kwargs):
            got.append(kwargs["tenant"])
            return await real_generate(*args, **kwargs)

        def stream(*args, **kwargs):
            got.append(kwargs["tenant"])
            return real_stream(*args, **kwargs)

        live.engine.generate, live.engine.stream = generate, stream  # type: ignore[method-assign]
        for key, extra in (("sk-a", {}), ("sk-b", {"stream": True}), ("sk-acme", {}), ("sk-a", {"user": "acme"})):
            r = http.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
    assert got == [key_group("sk-a"), key_group("sk-b"), tenant_group("acme"), key_group("sk-a")]
