"""pass26: hostile bodies against the newest HTTP paths (tools without or with odd ``parameters``, forced replies
cut short, ``stream_options``, ``top_p`` 0 and its neighbours, content parts, assistant tool calls): none is a 5xx,
every answer carries ``X-Request-Id``, every refusal is OpenAI's error shape. They held on main (pass26); kept as a
guard on those paths."""

from __future__ import annotations

import httpx
import pytest

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
BODIES = [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": None}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                              "function": {"name": "g"}}},
    {"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "stream": True},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "n": 2, "stream": True,
     "stream_options": {"include_usage": True}},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "parallel_tool_calls": False,
     "max_tokens": 1},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "response_format":
     {"type": "json_object"}},
    {"stream_options": {"include_usage": True}},
    {"stream_options": {"include_obfuscation": "no"}, "stream": True},
    {"stream_options": None, "stream": True},
    {"stream_options": [], "stream": True},
    {"stream_options": {"include_usage": True, "x": 1}, "stream": True},
    {"top_p": 0, "n": 3, "seed": 1},
    {"top_p": 0.0, "temperature": 2},
    {"top_p": -0.0},
    {"top_p": 1e-400},
    {"top_p": 2},
    {"top_p": "0"},
    {"top_p": True},
    {"top_p": 0, "top_k": 5},
    {"top_p": 0, "logprobs": True, "top_logprobs": 5},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "b"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
                  {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r"}]}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": None}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": []}]},
]


@pytest.mark.parametrize("extra", BODIES, ids=range(len(BODIES)))
def test_no_body_gets_a_500_or_a_bare_error(server, extra) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, **extra})
    print(r.status_code, r.text[:300])
    assert r.status_code < 500, r.text
    assert r.headers.get("x-request-id"), r.headers
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
