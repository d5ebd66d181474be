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


# ---- tenant names in request ids and log lines --------------------------------------------------------------

_IDS = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2}
_FORGED = "mallory\nINFO asyncinfer.requests: request finished id=alice%2Fchatcmpl-0 model=ids finish_reason=stop"


def test_a_user_field_with_a_line_break_is_no_tenant_and_writes_no_log_line(tiny_models, caplog) -> None:
    """With ``tenant_from="request"`` the body's ``user`` heads the engine's request id, and the request's log line
    printed the id as it was: a ``user`` holding a line break wrote a second line of the caller's choosing, one
    that posed as another tenant's request (a terminal escape in it erased the line before). A tenant name is 1 to
    128 printable characters now: anything else is a 400 naming ``user``; printable names of any script serve."""
    import logging

    import httpx

    from asyncinfer.server import ModelSpec, ServerSettings, create_app
    from tests.server.conftest import TINY_OPTIONS, LiveServer

    caplog.set_level(logging.INFO, logger="asyncinfer.requests")
    settings = ServerSettings(tenant_from="request")
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        for user in (_FORGED, "bob\x1b[2K", "tab\tbed", "next\x85line", "para\u2029graph"):
            r = http.post("/v1/completions", json={**_IDS, "user": user})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "user" and "printable characters" in error["message"], error
            assert r.headers["x-request-id"]
        for user in ("alice", "Zoë Ångström", "团队-7"):
            r = http.post("/v1/completions", json={**_IDS, "user": user})
            assert r.status_code == 200, r.text
        live.wait_idle()
    lines = [record.getMessage() for record in caplog.records if record.name == "asyncinfer.requests"]
    assert len(lines) == 3 and all("\n" not in line for line in lines), lines
    assert [line.split(" model=")[0].split("/")[0] for line in lines] == [
        "request finished id=alice", "request finished id='Zoë Ångström", "request finished id=团队-7"]


def test_a_tenant_header_with_a_control_character_is_a_400(trusting) -> None:
    """A proxy's tenant header is read as latin-1: its byte 0x85 is NEL, a line break to many log readers, and a tab
    passes the HTTP parsers; both are refused by the header's name, before anything runs."""
    import httpx

    from tests.server.conftest import KEYS

    with httpx.Client(base_url=trusting.url, timeout=60, headers={"authorization": f"Bearer {KEYS[0]}"}) as http:
        for value in (b"team\x85forged", b"team\tx"):
            r = http.post("/v1/completions", json=_IDS, headers={"x-team": value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_tenant" and "printable" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json=_IDS, headers={"x-team": b"team-a"}).status_code == 200


def test_a_keys_tenant_name_is_held_to_the_same_rule() -> None:
    from asyncinfer import InvalidParameterError
    from asyncinfer.server import Tenant

    with pytest.raises(InvalidParameterError, match="printable characters"):
        Tenant("ops\nadmin")
    assert Tenant("Équipe bleue").name == "Équipe bleue"


async def test_a_request_id_of_the_callers_own_is_one_quoted_field_of_its_log_line(tiny_models, caplog) -> None:
    """In-process, a request id is the caller's to choose (any string of up to 512 characters): the log line shows
    one holding a space or a character that is not printable quoted and escaped, so it stays one line and one
    field; a plain id is shown as before."""
    import logging

    from asyncinfer import AsyncEngine, SamplingParams

    caplog.set_level(logging.INFO, logger="asyncinfer.requests")
    options = {"kv_cache_memory": 4 << 20, "max_model_len": 64, "dtype": "float32", "device": "cpu", "num_threads": 1}
    async with await AsyncEngine.load(tiny_models["qwen2"][0], **options) as engine:
        for request_id in ("plain-1", "two words", "line\nbreak"):
            await engine.generate([5, 6], SamplingParams(max_tokens=1), request_id=request_id)
    lines = [record.getMessage() for record in caplog.records if record.name == "asyncinfer.requests"]
    assert [line.split(" model=")[0] for line in lines] == [
        "request finished id=plain-1", "request finished id='two words'", "request finished id='line\\nbreak'"]


# ---- ServerSettings.instance_id -----------------------------------------------------------------------------


@pytest.mark.parametrize("instance", ["副本-1", "a\r\nset-cookie: x=1", " padded ", "", "x" * 257, 7])
def test_an_instance_id_that_cannot_be_a_header_is_refused_by_name(instance) -> None:
    """``instance_id`` is sent as a header on every answer: one of another alphabet was a 500 (or a dropped
    connection) on every request the server answered, one holding a line break dropped them all."""
    from asyncinfer import InvalidParameterError
    from asyncinfer.server import ServerSettings

    with pytest.raises(InvalidParameterError) as refused:
        ServerSettings(instance_id=instance)
    assert refused.value.parameter == "instance_id" and "printable ASCII" in refused.value.allowed


def test_every_answer_names_the_instance_not_only_the_routes(tiny_models) -> None:
    """docs/scale_out.md: every response carries ``X-Asyncinfer-Instance``. The router set it on its own routes'
    answers only: a 404 of no route, a 405 of a wrong method or the guard's 413 came without it. Each carries it
    once now."""
    import httpx

    from asyncinfer.server import ModelSpec, ServerSettings, create_app
    from tests.server.conftest import TINY_OPTIONS, LiveServer

    settings = ServerSettings(instance_id="replica-7", max_body_bytes=1024, api_keys=("k1",))
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        key = {"authorization": "Bearer k1"}
        answers = [
            http.get("/nowhere", headers=key),
            http.delete("/v1/completions", headers=key),
            http.post("/v1/completions", headers={**key, "content-type": "application/json"},
                      content=b"{" + b" " * 4096 + b"}"),
            http.get("/v1/models"),
            http.get("/v1/models", headers=key),
            http.post("/v1/completions", headers=key, json=_IDS),
            http.get("/health"),
        ]
    assert [r.status_code for r in answers] == [404, 405, 413, 401, 200, 200, 200]
    for r in answers:
        assert r.headers.get_list("x-asyncinfer-instance") == ["replica-7"], (r.status_code, r.headers)
        assert r.headers["x-request-id"]
