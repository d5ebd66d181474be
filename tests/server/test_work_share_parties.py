"""Whose worker threads a call's off-loop work takes is decided before its body is read, from the headers as the
call's own checks will read them: a tenant header given twice, or one the call will refuse, names no tenant's threads
(the key's are taken). Of two copies the first may be a client's own, sent ahead of the copy a trusted proxy appends:
an embeddings call (whose header check comes after its body) had its large body decoded in the threads of the tenant
its caller named, and only then was refused."""

from __future__ import annotations

import httpx
import pytest

from asyncinfer import threads
from asyncinfer.server import ModelSpec, ServerSettings, create_app

from .conftest import TINY_OPTIONS, LiveServer

PAD = " " * 6000  # past the loop's share: the body is decoded in a worker thread, one of the caller's


@pytest.fixture
def parties(monkeypatch) -> list:
    """The party of each ``WorkShares.run`` call, in order."""
    seen: list = []
    real = threads.WorkShares.run

    async def recorded(self, party, fn, /, *args):
        seen.append(party)
        return await real(self, party, fn, *args)

    monkeypatch.setattr(threads.WorkShares, "run", recorded)
    return seen


@pytest.mark.parametrize("route", ["/v1/embeddings", "/v1/completions"])
@pytest.mark.parametrize("headers", [
    [("X-Team", "victim"), ("X-Team", "mine")],  # the client's copy first, the proxy's after it
    [("X-Team", b"vic\ttim")],  # not printable: refused by the call's check
])
def test_a_refused_tenant_header_takes_no_tenants_threads(tiny_models, parties, route, headers) -> None:
    settings = ServerSettings(api_keys=("sk-a",), tenant_from="header", tenant_header="X-Team")
    body = ('{"model":"ids","input":"hi"}' if route == "/v1/embeddings" else
            '{"model":"ids","prompt":[1,2,3],"max_tokens":1}') + PAD
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live:
        answer = httpx.post(live.url + route, content=body.encode(), timeout=60, headers=[
            ("authorization", "Bearer sk-a"), ("content-type", "application/json"), *headers])
    assert answer.status_code == 400, answer.text  # (an embeddings call to a generator: refused for that first)
    assert all(party == ("key", "sk-a") for party in parties), parties
    assert parties or route == "/v1/completions"  # (a generation's duplicate is refused before its body is read)


@pytest.mark.parametrize(("settings", "headers", "party"), [
    (ServerSettings(), [], None),  # no keys: nobody to tell apart, the pool as the work comes
    (ServerSettings(tenant_from="header", tenant_header="X-Team"), [("X-Team", "t")], ("tenant", "t")),
    (ServerSettings(api_keys=("sk-a",)), [("authorization", "Bearer sk-a")], ("key", "sk-a")),
], ids=["keyless", "keyless-tenant", "key"])
def test_a_call_without_a_key_or_tenant_takes_the_pool(tiny_models, parties, settings, headers, party) -> None:
    """On a server without API keys every caller was one party of two threads: two callers' long logprobs answers
    held every other caller's large body."""
    body = '{"model":"ids","prompt":[1,2,3],"max_tokens":1}' + PAD
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live:
        answer = httpx.post(live.url + "/v1/completions", content=body.encode(), timeout=60,
                            headers=[("content-type", "application/json"), *headers])
    assert answer.status_code == 200, answer.text
    assert parties[:1] == [party], parties  # the body's decoding
