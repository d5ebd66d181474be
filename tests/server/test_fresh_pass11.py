"""Adversarial pass 11 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import httpx
import pytest


# A text prompt sent to /v1/completions for a model loaded without a tokenizer was answered with the chat's message:
# "so chat messages cannot be rendered for it: send its prompt to /v1/completions as token ids" -- no chat was sent,
# and the route it points to is the one that refused it. The 400 now says what is wrong with the prompt.
@pytest.mark.parametrize("stream", [False, True])
def test_a_text_prompt_for_a_model_without_a_tokenizer_says_to_send_token_ids(server, stream) -> None:
    body = {"model": "ids", "prompt": "abc", "max_tokens": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["x-request-id"].startswith("cmpl-")
    assert r.json() == {
        "error": {
            "message": "This model was loaded without a tokenizer, so a text prompt cannot be encoded for it: send "
            "`prompt` as token ids (a list of integers, or a list of such lists).",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
    }
