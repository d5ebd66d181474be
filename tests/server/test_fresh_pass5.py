"""Adversarial pass 5: what one caller's request can do over HTTP, and whether each refusal names what the caller
sent. Each case here was a fault on main before it was fixed."""

from __future__ import annotations

import httpx

from asyncinfer.server import create_app
from asyncinfer.server.settings import ModelSpec, ServerSettings

from .conftest import TINY_OPTIONS, LiveServer

TEXT = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}


def test_a_priority_header_past_the_engines_range_is_refused_by_the_headers_name(tiny_models) -> None:
    """``X-Priority: 99999999999`` (digits, so it passed the header's check) reached the engine, whose 400 named
    ``priority``: a body field the client had not sent, and one this server refuses. It is the header's 400 now,
    ``invalid_priority``, with the range; the ends of the range are served."""
    settings = ServerSettings(tenant_from="header", priority_header="X-Priority")
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        for value in ("2147483648", "-2147483649", "9" * 40):
            r = http.post("/v1/completions", headers={"x-priority": value}, json=TEXT)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "invalid_priority" and error["param"] is None, error
            assert "x-priority" in error["message"].lower() and "2147483647" in error["message"]
            assert r.headers["x-request-id"]
        for value in ("2147483647", "-2147483648"):
            assert http.post("/v1/completions", headers={"x-priority": value}, json=TEXT).status_code == 200
