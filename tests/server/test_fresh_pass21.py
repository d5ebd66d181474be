"""A twenty-first adversarial pass over the HTTP server, as a hostile tenant of a shared one: each finding held to
its fix."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncinfer.errors import InvalidParameterError
from asyncinfer.server import ModelSpec, ServerSettings, Tenant, create_app
from tests.server.conftest import TINY_OPTIONS, LiveServer

GREEDY = "sk-greedy"
NEIGHBOUR = "sk-neighbour"
#: Requests of 480 tokens on one seat: each holds the engine for hundreds of steps, so the ones behind it wait.
LONG = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "temperature": 0}
SHORT = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _fill(live: LiveServer, key: str, count: int) -> tuple[list[threading.Thread], list[int]]:
    """``count`` long completions sent by ``key`` in threads of their own, once each is in flight or refused: the
    threads and the statuses (appended as they end)."""
    statuses: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=live.url, timeout=120) as http:
            statuses.append(http.post("/v1/completions", json=LONG, headers=_bearer(key)).status_code)

    threads = []
    for sent in range(1, count + 1):
        thread = threading.Thread(target=send)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 30
        while live.engine.num_unfinished_requests + sum(s != 200 for s in statuses) < sent:
            assert time.monotonic() < deadline, "a request neither ran nor was refused"
            time.sleep(0.002)
    return threads, statuses


@pytest.fixture(scope="module")
def capped(tiny_models):
    """One seat and three places to wait (four requests in flight at most), each tenant two of them."""
    settings = ServerSettings(tenants={GREEDY: Tenant("greedy"), NEIGHBOUR: Tenant("neighbour")},
                              max_requests_per_tenant=2)
    options = dict(TINY_OPTIONS, max_num_seqs=1, max_waiting_requests=3)
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", options), settings)) as live:
        yield live


def test_one_tenant_cannot_take_every_place_in_the_queue(capped) -> None:
    """Admission control (``max_num_seqs + max_waiting_requests``) counts every tenant's requests together: one
    tenant holding all the places made every other tenant's request a 503 ``overloaded``, however little it asked.
    With ``max_requests_per_tenant`` a tenant past its share is refused alone, a 429 naming the limit, and the
    others keep their places."""
    threads, statuses = _fill(capped, GREEDY, 4)
    with httpx.Client(base_url=capped.url, timeout=120) as http:
        refused = http.post("/v1/completions", json=SHORT, headers=_bearer(GREEDY))  # both its places still held
        neighbour = http.post("/v1/completions", json=SHORT, headers=_bearer(NEIGHBOUR))
    for thread in threads:
        thread.join(120)
    assert neighbour.status_code == 200, neighbour.text
    assert sorted(statuses) == [200, 200, 429, 429]
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1" and refused.headers["x-request-id"]
    assert refused.json()["error"] == {
        "message": "This tenant has 2 requests in flight, the most this server allows one tenant "
                   "(max_requests_per_tenant=2): retry when one has ended.",
        "type": "rate_limit_error", "param": None, "code": "tenant_requests_exceeded"}
    capped.wait_idle(60)


def test_a_tenants_places_come_back_however_its_calls_end(capped) -> None:
    """Streams read to the end, streams dropped after their first event, a call of two prompts, and a call refused
    after its places were taken (a prompt too long) all give their places back: the tenant has both again."""
    with httpx.Client(base_url=capped.url, timeout=120) as http:
        for _ in range(3):
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}, headers=_bearer(GREEDY)) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # then dropped
            r = http.post("/v1/completions", json={**SHORT, "stream": True}, headers=_bearer(GREEDY))
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            r = http.post("/v1/completions", json={**SHORT, "prompt": [[5], [6]]}, headers=_bearer(GREEDY))
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
            r = http.post("/v1/completions", json={**SHORT, "prompt": [5] * 600}, headers=_bearer(GREEDY))
            assert r.status_code == 400
            r = http.post("/v1/completions", json={**SHORT, "prompt": [[5], [6], [7]]}, headers=_bearer(GREEDY))
            assert r.status_code == 400 and r.json()["error"]["code"] == "tenant_requests_exceeded"  # never fits
    capped.wait_idle(30)
    threads, statuses = _fill(capped, GREEDY, 2)
    for thread in threads:
        thread.join(120)
    assert statuses == [200, 200]


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_max_requests_per_tenant_is_checked(value) -> None:
    with pytest.raises(InvalidParameterError, match="max_requests_per_tenant"):
        ServerSettings(max_requests_per_tenant=value)


def test_serve_names_the_flag(tiny_models, capsys, monkeypatch) -> None:
    """``asyncinfer serve --max-requests-per-tenant`` sets it, and a bad value is named by its flag."""
    import asyncinfer.server
    from asyncinfer import cli
    from tests.cli.test_serve_command import free_port

    def no_load(*args, **kwargs):
        raise AssertionError("served")

    monkeypatch.setattr(asyncinfer.server, "run_server", no_load)
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    path = str(tiny_models["llama"][0])
    assert cli.main(["serve", path, "--port", str(free_port()), "--max-requests-per-tenant", "0"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: --max-requests-per-tenant 0 is invalid: allowed an integer >= 1\n"


_KINDS = ("whole", "stream", "dropped", "two_prompts", "too_long", "gone")


def _call(live: LiveServer, kind: str) -> int:
    """One call of ``kind`` by the greedy tenant: its status (0 for a client that went away)."""
    with httpx.Client(base_url=live.url, timeout=120) as http:
        if kind in ("stream", "dropped"):
            with http.stream("POST", "/v1/completions", json={**SHORT, "max_tokens": 40, "stream": True},
                             headers=_bearer(GREEDY)) as r:
                for _ in r.iter_lines() if kind == "stream" else ():
                    pass
                return r.status_code
        body = {"whole": SHORT, "two_prompts": {**SHORT, "prompt": [[5], [6]]}, "too_long": {**SHORT, "prompt": [5] * 600},
                "gone": LONG}[kind]
        try:
            return http.post("/v1/completions", json=body, headers=_bearer(GREEDY),
                             timeout=0.05 if kind == "gone" else 120).status_code
        except httpx.TimeoutException:
            return 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(_KINDS), min_size=1, max_size=6))
def test_places_never_leak_whatever_the_calls(capped, kinds) -> None:
    """Calls of every ending, sent together (so that some are refused with a 429 while others hold the places):
    once they have all ended, the tenant has both its places again."""
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda k=k: statuses.append(_call(capped, k))) for k in kinds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert set(statuses) <= {0, 200, 400, 429}, statuses
    capped.wait_idle(60)
    deadline = time.monotonic() + 10
    while True:  # a dropped call's answer ends a moment after its client has gone
        threads, filled = _fill(capped, GREEDY, 3)
        for thread in threads:
            thread.join(120)
        if sorted(filled) == [200, 200, 429] or time.monotonic() > deadline:
            break
        capped.wait_idle(60)
    assert sorted(filled) == [200, 200, 429]
    capped.wait_idle(60)


@pytest.mark.parametrize(("body", "param"), [
    ({**SHORT, "prompt": [5, 10**6]}, "prompt"),  # a token id past the vocabulary
    ({**SHORT, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({**SHORT, "n": 2, "temperature": 1.0}, "n"),  # past max_num_seqs=1: its samples never run together
    ({**SHORT, "prompt": [5] * 600}, "prompt"),  # past max_model_len
], ids=["token_id", "stop_token_id", "n", "too_long"])
def test_a_tenant_at_its_limit_gets_its_invalid_request_refused_as_invalid(capped, body, param) -> None:
    """A request no retry can run is a 400 naming its field even while its tenant holds all its places: the places
    were counted first, so each was a 429 with Retry-After, and a client retried what could never run."""
    threads, statuses = _fill(capped, GREEDY, 2)
    with httpx.Client(base_url=capped.url, timeout=120) as http:
        refused = http.post("/v1/completions", json=body, headers=_bearer(GREEDY))
    for thread in threads:
        thread.join(120)
    assert statuses == [200, 200]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert "retry-after" not in refused.headers
    capped.wait_idle(60)
