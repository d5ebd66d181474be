"""An eighth stranger's first hour with the HTTP server: what misled, each held to its fix."""

from __future__ import annotations

import httpx

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_chat_to_a_model_that_cannot_render_chats_points_to_completions(server) -> None:
    """A chat completion for a model without a tokenizer said "messages='chat messages' is invalid: allowed token
    ids: ..." (and without a chat template "allowed text or token ids"): `messages` can be neither. The 400 now
    says why and where to send the prompt."""
    for body in (
        {"model": "ids", "messages": MESSAGES, "max_tokens": 2},
        {"model": "ids", "messages": MESSAGES, "max_tokens": 2, "stream": True},
    ):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert error["message"] == (
            "This model was loaded without a tokenizer, so chat messages cannot be "
            "rendered for it: send its prompt to /v1/completions as token ids."
        )
    r = httpx.post(
        server.url + "/v1/completions", json={"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200, r.text  # where the message sends it, it is served


def test_a_chat_refused_for_want_of_a_template_says_so_and_names_the_completions_route() -> None:
    """The same for a model with a tokenizer but no chat template (a base model's GGUF file), as the
    engine refuses it."""
    from asyncinfer.errors import InvalidParameterError
    from asyncinfer.prompts import NO_CHAT_TEMPLATE
    from asyncinfer.server.errors import from_exception

    refused = InvalidParameterError("prompt", "chat messages", NO_CHAT_TEMPLATE)
    error = from_exception(refused, "req-1", {"prompt": "messages"}.get)
    assert (error.status, error.param) == (400, "messages")
    assert error.message == (
        "This model has no chat template, so chat messages cannot be rendered for it: send "
        "its prompt to /v1/completions as text."
    )
