"""A fresh stranger's trial (round of issue 25): what it found in the HTTP layer.

A constrained (``tool_choice`` ``"required"`` or named) Hermes call whose reply ``max_tokens`` cut after the
arguments had closed, inside the call's own ``}`` and ``</tool_call>``: the held end of the block was sent as
part of ``function.arguments`` (``'{"city": "Paris"}}\\n</tool_call'``, which no client can parse), though the
model had written the whole arguments. The default model did it with ``tool_choice="required"``, seed 4 and
``max_tokens=40``.
"""

from __future__ import annotations

import json

import pytest

from asyncinfer.server.responses import Reply
from asyncinfer.server.tools import CallStream, parse_tool_use, read_calls
from tests.helpers import gather_tool_deltas

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
#: Arguments that end in a nested object's brace: their own last ``}`` looks like the call's.
NESTED = '{"city": "Paris", "where": {"near": {}}}'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + NESTED + '}\n</tool_call>'
TAIL = "}\n</tool_call>"  # the call's own brace and the block's end, after the arguments


def _streamed(text: str, size: int, use) -> tuple[str, list[dict], bool]:
    stream = CallStream(use)
    deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
    content, calls = gather_tool_deltas(deltas)
    return content, calls, stream.in_call


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("kept", range(1, len(TAIL)))  # cut after 1 .. 13 characters of the 14 of the tail
def test_a_call_cut_inside_its_end_keeps_exactly_the_arguments_written(choice, kept) -> None:
    use = parse_tool_use([WEATHER], choice, None)
    text = CALL[: len(CALL) - len(TAIL) + kept]
    content, [call], cut = read_calls(text, use)
    assert content is None
    assert call["function"] == {"name": "get_weather", "arguments": NESTED}  # the block's end is not theirs
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "where": {"near": {}}}
    assert cut is False  # the arguments are whole: it was not cut inside them
    for size in (1, 2, 3, 7, len(text)):
        _content, calls, in_call = _streamed(text, size, use)
        assert [c["function"] for c in calls] == [call["function"]], size
        assert in_call is False, size
    body = Reply(True, "chatcmpl-1", 0, "m", None, False, tools=use).choice(0, text, None, "length")
    assert body["finish_reason"] == "length"
    assert body["message"]["tool_calls"][0]["function"]["arguments"] == NESTED


def test_a_call_cut_at_its_arguments_last_brace_keeps_that_brace() -> None:
    """The held ``}`` closes the arguments themselves here (they do not parse without it): it is theirs, and the
    arguments are whole (not cut inside them); one character earlier they are cut."""
    use = parse_tool_use([WEATHER], "required", None)
    text = CALL[: len(CALL) - len(TAIL)]
    _content, [call], cut = read_calls(text, use)
    assert call["function"]["arguments"] == NESTED and cut is False
    inner = CALL[: len(CALL) - len(TAIL) - 1]  # cut before the arguments' own last brace
    _content, [call], cut = read_calls(inner, use)
    assert call["function"]["arguments"] == NESTED[:-1] and cut is True


@pytest.mark.parametrize("tail", ["}\n</tool", "}", ""])
def test_arguments_nested_past_the_json_parsers_depth_are_read_whole(tail) -> None:
    """The closing's held brace was judged with json.loads, which raises RecursionError past ~1,000 levels of
    nesting (a constrained reply may nest that far): the reply failed. Its brackets decide there."""
    use = parse_tool_use([WEATHER], "required", None)
    args = '{"city": ' + "[" * 3000 + '"a\\"]"' + "]" * 3000 + "}"
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + args + tail
    _content, [call], cut = read_calls(text, use)
    assert call["function"]["arguments"] == args and cut is False
    _content, [call], cut = read_calls(text[:-len(tail) - 1] if tail else text[:-1], use)  # cut inside them
    assert call["function"]["arguments"] == args[:-1] and cut is True
