"""A third fresh adversarial pass (issue 25): what one caller's request can do to another's, in-process and
over HTTP. Each case here was a fault on main before it was fixed."""

from __future__ import annotations

import httpx
import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import CHAT_BODY, COMPLETION_BODY, decode_json, parse_chat, parse_completion
from asyncinfer.structured import StructuredOutput

from .conftest import TINY_OPTIONS

VICTIM_CHOICE = StructuredOutput.choice(["yes-victim", "no-victim"])
VICTIM_REGEX = StructuredOutput.regex("(yes|no)-victim")


class PosingSpec(StructuredOutput, frozen=True, kw_only=True):
    """A spec that hashes and compares as the victim's, whatever it holds."""

    def __hash__(self) -> int:
        return hash(VICTIM_CHOICE)

    def __eq__(self, other: object) -> bool:
        return True


class PosingText(str):
    """A str that hashes and compares as the victim's pattern, whatever it holds."""

    def __hash__(self) -> int:
        return hash(VICTIM_REGEX.value)

    def __eq__(self, other: object) -> bool:
        return True


def test_a_spec_is_kept_as_the_plain_spec_it_holds() -> None:
    params = SamplingParams(structured=PosingSpec(kind="regex", value="a+"))
    assert type(params.structured) is StructuredOutput and params.structured == StructuredOutput.regex("a+")
    assert params.structured != VICTIM_CHOICE
    spec = StructuredOutput.regex(PosingText("a+"))
    assert type(spec.value) is str and spec != VICTIM_REGEX and hash(spec) != hash(VICTIM_REGEX)
    choices = StructuredOutput.choice([PosingText("a"), "b"])
    assert [type(c) for c in choices.value] == [str, str] and type(choices.value) is tuple


@pytest.mark.parametrize(("hostile", "victim"), [
    (lambda: PosingSpec(kind="regex", value="a+"), VICTIM_CHOICE),
    (lambda: StructuredOutput.regex(PosingText("a+")), VICTIM_REGEX),
])
async def test_a_spec_posing_as_anothers_never_lends_it_its_grammar(tiny_chat_model, hostile, victim) -> None:
    """The compiled-grammar cache is keyed by the spec: a StructuredOutput subclass (or a spec holding a str
    subclass) whose ``__hash__`` and ``__eq__`` posed as another caller's spec put its own grammar in that spec's
    entry, and the other caller's request (same namespace: no cache salt, as in-process callers are) followed
    it: asked for "yes-victim" or "no-victim", it wrote "aaaaaaaa". A spec is now the plain spec it holds."""
    pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")
    async with AsyncEngine.from_pretrained(str(tiny_chat_model), **TINY_OPTIONS) as engine:
        own = await engine.generate("hello", SamplingParams(max_tokens=5, structured=hostile()))
        assert own.outputs[0].text == "aaaaa"
        answer = await engine.generate("hello", SamplingParams(max_tokens=16, structured=victim))
        assert answer.outputs[0].text in ("yes-victim", "no-victim"), answer.outputs[0].text


# Invalid UTF-8 inside a field the body's decoder keeps as raw text (skipped unread, so never checked as UTF-8 there)
# and reads later: msgspec's DecodeError escaped the router's checks as a 500 "internal_error" (logged as an engine
# fault). Each is now a 400 naming the field, as the same bytes in a field decoded with the body are refused.
BAD = b"h\xc0\xafi"  # an overlong "/" (a classic filter bypass): not UTF-8
HI = b'[{"role": "user", "content": "hi"}]'
INVALID_UTF8 = [  # (parse, body, param)
    ("chat", b'{"messages": [{"role": "user", "content": "' + BAD + b'"}]}', "messages.[0].content"),
    ("chat", b'{"messages": [{"role": "us' + BAD + b'", "content": "hi"}]}', "messages.[0]"),
    ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "' + BAD + b'"}]}]}',
     "messages.[0].content.[0]"),
    ("chat", b'{"messages": [{"role": "user", "content": ["' + BAD + b'"]}]}', "messages.[0].content.[0]"),
    ("chat", b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "' + BAD + b'"}]}]}',
     "messages.[0]"),
    ("chat", b'{"messages": ' + HI + b', "metadata": {"k": "' + BAD + b'"}}', "metadata"),
    ("chat", b'{"messages": ' + HI + b', "logit_bias": "' + BAD + b'"}', "logit_bias"),
    ("chat", b'{"messages": ' + HI + b', "functions": ["' + BAD + b'"]}', "functions"),
    ("text", b'{"prompt": "hi", "echo": "' + BAD + b'"}', "echo"),
    ("text", b'{"prompt": "hi", "suffix": "' + BAD + b'"}', "suffix"),
]


@pytest.mark.parametrize(("route", "body", "param"), INVALID_UTF8, ids=[p for _, _, p in INVALID_UTF8])
def test_invalid_utf8_in_a_raw_field_is_a_400_naming_it(route, body, param) -> None:
    shape, parse = (CHAT_BODY, parse_chat) if route == "chat" else (COMPLETION_BODY, parse_completion)
    with pytest.raises(APIError) as refused:
        parse(decode_json(body, shape))
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message
    assert "UTF-8" in refused.value.message


def test_invalid_utf8_in_a_message_over_http_is_a_400(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for route, body, param in INVALID_UTF8:
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            r = http.post(path, content=body.replace(b"{", b'{"model": "tiny", "max_tokens": 2, ', 1),
                          headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.status_code, r.text)
            assert r.headers["x-request-id"]
        ok = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_a_stream_nobody_reads_is_closed_after_send_timeout_and_its_requests_aborted(tiny_chat_model) -> None:
    """A client that asks for a large stream (16 samples of 500 tokens with 20 alternatives each) and then reads
    nothing filled its connection's send buffer: the server waited on it for ever, the connection open (one of
    ``max_connections``) and its 16 samples held in the engine (their seats and KV blocks), past every header
    and body deadline; the server could not even stop. Now the connection is closed once its buffer has stayed
    full for ``send_timeout``, and its requests are aborted as on a disconnect."""
    import json
    import socket
    import time

    from asyncinfer.server import ModelSpec, ServerSettings, create_app

    from .conftest import LiveServer

    settings = ServerSettings(header_timeout=2.0, send_timeout=1.0)
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), settings)
    with LiveServer(app, settings) as live:
        host, port = live.url.removeprefix("http://").split(":")
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 500, "n": 16, "temperature": 1,
                           "ignore_eos": True, "logprobs": 20, "stream": True}).encode()
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        silent.connect((host, int(port)))
        silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            deadline = time.monotonic() + 60
            while live.engine.num_unfinished_requests == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert live.engine.num_unfinished_requests > 0  # it is being served
            while (live.server.server_state.connections or live.engine.num_unfinished_requests) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not live.server.server_state.connections, "the silent client's connection is still open"
            live.wait_idle()  # its samples were aborted, their blocks freed
            r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
        finally:
            silent.close()
