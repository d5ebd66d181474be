"""Adversarial pass 13 (issue 25), HTTP side: what one caller's reply costs the server's event loop.

A chat with ``tools`` streamed from a model in Llama 3.x's or Mistral's JSON call syntax is read for calls piece
by piece, on the event loop (each piece is short). The reader skipped the whitespace before a value from the
value's first place at every piece: a reply that wrote whitespace after ``[TOOL_CALLS][`` or after a call's
``;`` cost each piece a Python loop over all the whitespace so far, quadratic in the reply (4,000 pieces of 8
spaces held the loop 9 s, every other caller's stream waiting).
"""

from __future__ import annotations

import time

import pytest

from asyncinfer.server import tool_formats
from asyncinfer.server.tool_formats import Llama3JsonFormat, MistralFormat
from asyncinfer.server.tools import parse_tool_use, read_calls

_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_FORMATS = {"mistral": (MistralFormat(None), "[TOOL_CALLS]["),
            "llama3_json": (Llama3JsonFormat(), '{"name": "f", "parameters": {}};')}


@pytest.mark.parametrize("name", list(_FORMATS))
def test_whitespace_before_a_call_is_read_once_however_many_pieces_bring_it(monkeypatch, name) -> None:
    """Each character of a reply is looked at a bounded number of times, whatever the pieces: counted exactly
    (the characters the whitespace skip walks over), not timed."""
    fmt, opener = _FORMATS[name]
    walked = 0
    skip = tool_formats._skip

    def counting(text: str, at: int) -> int:
        nonlocal walked
        end = skip(text, at)
        walked += end - at
        return end

    monkeypatch.setattr(tool_formats, "_skip", counting)
    stream = parse_tool_use(_TOOLS, "auto", True).bound(fmt).stream()
    opened = stream.feed(opener)  # Mistral's list opens; Llama's first call is read whole, then ";"
    assert (opened == []) if name == "mistral" else (opened[0]["tool_calls"][0]["function"]["name"] == "f")
    walked = 0
    pieces = 2000
    for _ in range(pieces):
        assert stream.feed(" " * 8) == []
    assert walked <= 8 * pieces, walked  # each space once (before: about 8 * pieces**2 / 2 = 16 million)
    deltas = stream.feed('{"name": "f", "%s": {"a": 1}}' % ("arguments" if name == "mistral" else "parameters"))
    deltas += stream.finish()
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": ""}, {"arguments": '{"a": 1}'}]
    assert calls[0]["index"] == (0 if name == "mistral" else 1)


@pytest.mark.parametrize("name", list(_FORMATS))
def test_a_reply_of_whitespace_after_a_call_opens_holds_the_loop_only_briefly(name) -> None:
    """The same reply as 4,000 pieces of 8 spaces: a few milliseconds in all (it took 9 s)."""
    fmt, opener = _FORMATS[name]
    stream = parse_tool_use(_TOOLS, "auto", True).bound(fmt).stream()
    stream.feed(opener)
    start = time.process_time()
    for _ in range(4000):
        stream.feed(" " * 8)
    assert time.process_time() - start < 1.0


@pytest.mark.parametrize(("name", "text", "arguments"), [
    ("mistral", '[TOOL_CALLS][ \n\t {"name": "f", "arguments": {"a": 1}},\n\n  {"name": "f", "arguments": {}}]',
     ['{"a": 1}', "{}"]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}};   \n {"name": "f", "parameters": {"b": 2}}',
     ['{"a": 1}', '{"b": 2}']),
])
def test_calls_after_whitespace_are_still_read_whole(name, text, arguments) -> None:
    fmt, _ = _FORMATS[name]
    use = parse_tool_use(_TOOLS, "auto", True).bound(fmt)
    content, calls, cut = read_calls(text, use)
    assert content is None and not cut
    assert [c["function"]["arguments"] for c in calls] == arguments
