"""A fourteenth stranger's first hour with the HTTP server: what misled, each held to its fix."""

from __future__ import annotations

import httpx

from tests.server.conftest import LiveServer

MESSAGES = [{"role": "user", "content": "Hi"}]


def _tools(description: str, count: int = 8) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "description": description,
                                              "parameters": {"type": "object"}}} for i in range(count)]


def _too_long(server: LiveServer, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"], r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "messages",
                                                              "context_length_exceeded")
    return error


def test_a_prompt_made_long_by_its_tools_names_the_tools(server) -> None:
    """A chat of one "Hi" with tools whose descriptions fill the context was told "your `messages` resulted in
    42884 tokens. Please reduce the length of `messages`.": the tools are rendered into the prompt, and the fix
    (shorter or fewer tools) was never named. OpenAI names the functions too."""
    error = _too_long(server, {"messages": MESSAGES, "tools": _tools("word " * 40)})
    head, _, tail = error["message"].partition("However, your `messages` and `tools` (rendered into the prompt) "
                                               "resulted in ")
    assert head == ("This model's maximum context length is 512 tokens (prompt and output together), and the "
                    "prompt may take at most 511 of them. "), error["message"]
    count, _, rest = tail.partition(" ")
    assert int(count) > 511 and rest == "tokens. Please reduce the length of `messages` or `tools`.", error["message"]
    error = _too_long(server, {"messages": MESSAGES, "tools": _tools("d" * 40_000)})
    assert "However, your `messages` and `tools` (rendered into the prompt) have " in error["message"], error
    assert error["message"].endswith("Please reduce the length of `messages` or `tools`."), error


def test_tools_not_shown_to_the_model_are_not_named(server) -> None:
    """With ``tool_choice: "none"`` the tools are left out of the prompt: only `messages` is named, as before."""
    error = _too_long(server, {"messages": [{"role": "user", "content": "x" * 4000}], "tools": _tools("word"),
                               "tool_choice": "none"})
    assert "`tools`" not in error["message"], error
    assert error["message"].endswith("Please reduce the length of `messages`."), error
