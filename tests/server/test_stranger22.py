"""A porter's first hour (stranger22): an application moved from OpenAI's API to ``asyncinfer serve`` with the
official ``openai`` client, each call it made tried; what answered otherwise than OpenAI documents, held to its fix.

- A function tool without ``parameters`` is, in OpenAI's words, "a function with an empty parameter list". It was
  read as any object: a forced call of the default model's ``get_time`` wrote ``{"time": "2023-01-`` until
  ``max_tokens`` (``finish_reason`` ``"length"``, arguments that do not parse).
- A forced reply (``tool_choice`` ``"required"`` or named) cut before its first call's name was whole (``max_tokens``
  of a few tokens, ``stop=["\\n"]``) answered the grammar's opening as the content: ``"<tool_call>\\n{\"name"``, no
  call. Its content is null now, whole and streamed (a stream opened with ``content: ""``, gathered as ``""`` where
  the whole answer said null).
- ``top_p: 0``, in OpenAI's range ([0, 1]), was a 400 "allowed a number in (0, 1]" (the Python API's range);
  it keeps the most likely token alone now, as the sampler does with the smallest mass.
- ``stream_options.include_obfuscation`` (OpenAI's, a boolean) was a 400 "Unrecognized argument" even as
  ``false``, which is what this server does (its chunks carry no ``obfuscation`` padding).
- A 501 (no grammar library; a transfer coding other than ``chunked``) was retried by the openai client, as it
  retries every 5xx: three requests and their backoff for an answer no retry changes. It now says
  ``x-should-retry: false``, which the client obeys.
- Messages in Python's words, where docs/serving.md says they speak JSON: ``include_usage`` "must be a boolean, got
  str", a part's text "got int", a part that is no object "Only text content parts are supported, got "int""; and
  a tool call's shape written with two braces too many.
"""

from __future__ import annotations

import json
import socket

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from asyncinfer.server import ModelSpec, create_app
from asyncinfer.server.tools import parse_tool_use

from .conftest import LiveServer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What time is it?"}], "max_tokens": 4}
NOW = {"type": "function", "function": {"name": "get_time", "description": "The current time"}}  # no `parameters`


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def smol(real_gguf):
    app = create_app(ModelSpec(str(real_gguf), "smol", {"max_model_len": 1024, "kv_cache_memory": 64 * 1024 * 1024}))
    with LiveServer(app) as live, openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


# ------------------------------------------------------------------ a tool without parameters
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_tool_without_parameters_is_called_with_none(smol, choice) -> None:
    reply = smol.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What time is it?"}], tools=[NOW], tool_choice=choice,
        parallel_tool_calls=False, temperature=0, max_tokens=30)
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
    assert reply.choices[0].finish_reason == "tool_calls"


def test_a_tool_without_parameters_takes_no_argument() -> None:
    """The schema its calls are held to admits the empty object only; one with ``parameters`` keeps them."""
    use = parse_tool_use([NOW], "required", False)
    arguments = use.tools[0].call_schema()["properties"]["arguments"]
    jsonschema.validate({}, arguments)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"type": "object"}, arguments)
    zone = {"type": "object", "properties": {"zone": {"type": "string"}}}
    use = parse_tool_use([{"type": "function", "function": {"name": "get_time", "parameters": zone}}], "auto", True)
    assert use.tools[0].parameters == zone


# ------------------------------------------------------------------ a forced reply cut before its call
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
FORCED = {"model": "smol", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
          "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}


def _gathered(chunks) -> tuple[str | None, list[str], str | None]:
    """A stream's content (None where no chunk had any, not even ``""``), calls' names and finish_reason."""
    pieces, names, finish = [], [], None
    for chunk in chunks:
        (choice,) = chunk.choices
        pieces.append(choice.delta.content)
        names += [call.function.name for call in choice.delta.tool_calls or [] if call.function.name]
        finish = choice.finish_reason or finish
    content = None if all(p is None for p in pieces) else "".join(p or "" for p in pieces)
    return content, names, finish


@pytest.mark.parametrize("cut", [{"max_tokens": 1}, {"max_tokens": 4}, {"max_tokens": 8}, {"stop": ["\n"]}])
def test_a_forced_reply_cut_before_its_call_has_no_content(smol, cut) -> None:
    """The grammar's opening (``<tool_call>\n{"name``) was the answer's content, streamed and whole."""
    whole = smol.chat.completions.create(**FORCED, **cut).choices[0]
    assert (whole.message.content, whole.message.tool_calls) == (None, None)
    assert whole.finish_reason == ("stop" if "stop" in cut else "length")
    assert _gathered(smol.chat.completions.create(**FORCED, **cut, stream=True)) == (None, [], whole.finish_reason)


def test_a_forced_call_streams_as_its_whole_answer(smol) -> None:
    """Null content both ways (a stream opened with ``content: ""``, which the client kept as the content)."""
    whole = smol.chat.completions.create(**FORCED, max_tokens=40).choices[0]
    state = ChatCompletionStreamState()
    for chunk in smol.chat.completions.create(**FORCED, max_tokens=40, stream=True):
        state.handle_chunk(chunk)
    gathered = state.get_final_completion().choices[0]
    assert whole.finish_reason == gathered.finish_reason == "tool_calls"
    assert gathered.message.content is None is whole.message.content
    assert [c.function.arguments for c in gathered.message.tool_calls] == ['{"city": "Paris"}']


def test_an_auto_reply_keeps_its_text(smol) -> None:
    reply = smol.chat.completions.create(**{**FORCED, "tool_choice": "auto"}, max_tokens=4).choices[0]
    assert reply.message.content and reply.message.tool_calls is None
    first = next(iter(smol.chat.completions.create(**{**FORCED, "tool_choice": "auto"}, max_tokens=4, stream=True)))
    assert first.choices[0].delta.content == ""


# ------------------------------------------------------------------ top_p in OpenAI's range
def test_top_p_zero_keeps_the_most_likely_token(client) -> None:
    """OpenAI takes ``top_p`` in [0, 1]; 0 was a 400 here. It samples from the most likely token alone: greedy."""
    greedy = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=12, temperature=0)
    for seed in range(3):
        got = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=12, top_p=0,
                                             temperature=1.5, seed=seed, n=2)
        assert [c.message.content for c in got.choices] == [greedy.choices[0].message.content] * 2


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0"])
def test_top_p_outside_openais_range_says_it(http, value) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "top_p": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    assert "allowed a number in [0, 1] (OpenAI's range" in r.json()["error"]["message"]


# ------------------------------------------------------------------ stream_options.include_obfuscation
@pytest.mark.parametrize("value", [False, None])
def test_include_obfuscation_off_is_served(client, value) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": value}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(getattr(c, "obfuscation", None) is None for c in chunks)


def test_include_obfuscation_on_is_refused_by_name(client, http) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4, stream=True,
                                       stream_options={"include_obfuscation": True})
    assert (caught.value.param, caught.value.code) == ("stream_options.include_obfuscation", "unsupported_parameter")
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stream": True,
                                           "stream_options": {"include_obfuscation": "no"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == '`stream_options.include_obfuscation` must be a boolean, got "no".'


def test_other_stream_options_are_still_refused(http) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_tokens": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_tokens"


# ------------------------------------------------------------------ a 501 is not retried
def test_a_501_tells_the_client_not_to_retry(server, monkeypatch) -> None:
    import asyncinfer.grammar

    monkeypatch.setattr(asyncinfer.grammar, "library_missing",
                        lambda: "structured output needs llguidance (pip install 'asyncinfer[structured]'): gone")
    sent = []
    hooks = {"request": [sent.append]}
    retrying = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=2,
                             http_client=openai.DefaultHttpxClient(event_hooks=hooks))
    with retrying, pytest.raises(openai.InternalServerError) as caught:
        retrying.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4,
                                         response_format={"type": "json_object"})
    assert caught.value.status_code == 501 and caught.value.code == "not_implemented"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1  # was 3: the client retried it twice


def test_a_transfer_coding_501_says_not_to_retry(server) -> None:
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    if head.startswith(b"http/1.1 400"):  # h11 refuses the coding in its parser, before the app
        pytest.skip("this server's parser refuses the coding itself")
    assert head.startswith(b"http/1.1 501") and b"\r\nx-should-retry: false" in head, answer


def test_retryable_errors_do_not_say_so(http) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "temperature": 3})
    assert r.status_code == 400 and "x-should-retry" not in r.headers


# ------------------------------------------------------------------ JSON's words
@pytest.mark.parametrize(("messages", "param", "message"), [
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.[0].content.[0].text",
     "`messages.[0].content.[0].text` must be a string (the part's text), got 5."),
    ([{"role": "user", "content": [5]}], "messages.[0].content.[0]",
     '`messages.[0].content.[0]` must be a content part, {"type": "text", "text": ...}, got 5.'),
    ([{"role": "user", "content": ["hi"]}], "messages.[0].content.[0]",
     '`messages.[0].content.[0]` must be a content part, {"type": "text", "text": ...}, got "hi".'),
    ([{"role": "assistant", "content": None, "tool_calls": [5]}], "messages.[0].tool_calls.[0]",
     ('`messages.[0].tool_calls.[0]` must be {"id": ..., "type": "function", "function": {"name": ..., '
      '"arguments": ...}}.')),
])
def test_a_bad_message_is_named_in_json(http, messages, param, message) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["message"], error["code"]) == (param, message, None)


def test_an_unsupported_part_is_still_named_by_its_type(http) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]})
    error = r.json()["error"]
    assert (r.status_code, error["code"]) == (400, "unsupported_parameter")
    assert error["message"] == 'Only text content parts are supported, got "image_url".'


def test_include_usage_that_is_no_boolean_is_shown_as_sent(http) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == '`stream_options.include_usage` must be a boolean, got "yes".'
