"""A long number sent in a field is echoed cut, as a long text is: a 4,000-digit ``max_tokens`` was answered back
whole in its 400 (the message about 4,200 characters)."""

from __future__ import annotations

import httpx


def test_a_long_integer_is_echoed_cut_with_its_digit_count(server) -> None:
    digits = "7" * 4000
    body = ('{"model": "tiny", "prompt": "hi", "max_tokens": ' + digits + "}").encode()
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and f"{digits[:240]}... (4000 digits)" in error["message"], error
    assert len(error["message"]) < 600 and r.headers["x-request-id"]


def test_a_short_integer_is_echoed_whole(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": -12345},
                   timeout=60)
    assert r.status_code == 400 and "-12345" in r.json()["error"]["message"], r.text
