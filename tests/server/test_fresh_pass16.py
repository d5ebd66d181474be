"""A sixteenth adversarial pass over the HTTP server: each finding held to its fix."""

from __future__ import annotations

import httpx
import pytest

from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import decode_json

UTF16 = ("The request body is not valid JSON: it is UTF-16 text (a byte-order mark FF FE / FE FF, or a NUL byte beside "
         "each ASCII character, as PowerShell's Out-File and Notepad's \"Unicode\" write it): send it as UTF-8.")
BODY = '{"model": "tiny", "prompt": "a", "max_tokens": 1}'


@pytest.mark.parametrize("raw", [
    BODY.encode("utf-16"),  # with its byte-order mark, as Python and PowerShell write it
    BODY.encode("utf-16-le"),  # without one
    BODY.encode("utf-16-be"),
    "\ufeff".encode("utf-16-be") + BODY.encode("utf-16-be"),
])
def test_a_utf16_body_is_named_as_such(raw) -> None:
    """A body PowerShell's ``Out-File`` wrote (UTF-16) was refused as "JSON is malformed: invalid character (byte 0)"
    or "(byte 1)", the decoder's words, with nothing of the encoding to change."""
    with pytest.raises(APIError) as info:
        decode_json(raw)
    assert (info.value.status, info.value.message, info.value.param) == (400, UTF16, None)


@pytest.mark.parametrize("raw", [b"\x00", b'{"prompt": ', b"{" * 3])
def test_other_malformed_bodies_keep_the_decoders_words(raw) -> None:
    with pytest.raises(APIError) as info:
        decode_json(raw)
    assert info.value.status == 400 and "UTF-16" not in info.value.message
    assert info.value.message.startswith("The request body is not valid JSON: ")


def test_a_utf16_body_over_http_is_an_openai_400_with_a_request_id(server) -> None:
    r = httpx.post(server.url + "/v1/completions", content=BODY.encode("utf-16"),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"]
    assert r.json()["error"] == {"message": UTF16, "type": "invalid_request_error", "param": None, "code": None}
