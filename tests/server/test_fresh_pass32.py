"""pass32: the last adversarial pass, features together on a shared server (two tenants, API keys, a tiny KV cache).

A JSON schema over ``MAX_SPEC_CHARS`` (a tool's ``parameters``, a ``response_format`` schema) was measured by
writing it whole with ``json.dumps``, after a walk of all of it: a body of 4 MiB holding one schema of 130,000
properties cost 1.3 s of a worker thread over HTTP, and ``json.dumps`` is one C call that holds the GIL, so the
server's event loop stood still 0.2 to 0.3 s while it ran (measured beside the decode and check alone; a body of
the same size refused for its messages: 0.02 s). The walk counts the characters the JSON will have at least and
refuses the schema as soon as they pass the limit, before the rest is walked or any of it written: the loop's
longest stall is the body decode's (0.1 s), the refusal's CPU 0.2 to 0.4 s.

And each such refusal kept its whole body in memory until the next full garbage collection: the error, raised in
the worker thread that checks a long body, reached the loop through the thread's future, and its traceback held
the frame awaiting that future, which held the future, which held the error (a cycle). A tenant's refused 4 MiB
schemas grew the server by 50 MB each (20 of them: 600 MB to 1.6 GB, between two full collections). The worker
hands its error back as a value now; the refused body is freed as the answer is sent.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import httpx
import pytest

from asyncinfer import structured
from asyncinfer.errors import InvalidParameterError
from asyncinfer.server import ModelSpec, ServerSettings, Tenant, create_app
from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import CHAT_BODY, decode_json, parse_chat
from asyncinfer.structured import MAX_SPEC_CHARS, StructuredOutput

from .conftest import TINY_OPTIONS, LiveServer

PROPERTIES = 130_000  # a body of 3.9 MB, within the default 4 MiB max_body_bytes


class _Writes:
    """``json`` as asyncinfer.structured sees it, counting the characters ``dumps`` writes."""

    def __init__(self) -> None:
        self.chars = 0

    def dumps(self, value: Any, **options: Any) -> str:
        text = json.dumps(value, **options)
        self.chars += len(text)
        return text

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


def _big(properties: int = PROPERTIES) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


@pytest.mark.parametrize("field", ["tools", "response_format"])
def test_an_oversize_schema_in_a_body_is_refused_before_it_is_written_whole(monkeypatch, field: str) -> None:
    """What the server's worker thread does with such a body (the decode, then the fields' checks): the schema is
    refused naming its field, and ``json.dumps`` (one GIL-holding call: 0.3 s for this one) never writes it."""
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    if field == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": _big()}}]
        param = "tools.[0].function.parameters"
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": _big()}}
        param = "response_format.json_schema.schema"
    raw = json.dumps(body).encode()
    assert len(raw) < 4 * 1024 * 1024
    writes = _Writes()
    monkeypatch.setattr(structured, "json", writes)
    with pytest.raises(APIError) as caught:
        parse_chat(decode_json(raw, CHAT_BODY))
    assert caught.value.status == 400 and caught.value.param == param
    assert f"at most {MAX_SPEC_CHARS} characters" in str(caught.value)
    assert writes.chars <= MAX_SPEC_CHARS


def test_the_walk_stops_once_the_schema_is_past_the_limit() -> None:
    """The check walked every value of the schema before its size was known: 130,000 of them here (a shared value
    at each of a few dozen levels, in-process, was 2**depth of them). It stops at the limit now."""

    class Counted(dict):
        seen = 0

        def items(self):  # type: ignore[override]
            Counted.seen += 1
            return super().items()

    schema = {"type": "object", "properties": {f"p{i}": Counted(type="string") for i in range(PROPERTIES)}}
    with pytest.raises(InvalidParameterError, match=f"at most {MAX_SPEC_CHARS} characters"):
        StructuredOutput.json_schema(schema)
    assert Counted.seen < MAX_SPEC_CHARS // 16  # each property is 21 characters of JSON or more


def test_a_schema_at_the_limit_is_still_taken() -> None:
    """The count is a lower bound of the JSON written: a schema whose JSON is exactly the limit is taken, one
    character more refused (as before), whatever the walk counted."""
    head = {"type": "string", "description": ""}
    room = MAX_SPEC_CHARS - len(json.dumps(head, separators=(",", ":")))
    exact = {"type": "string", "description": "d" * room}
    assert len(StructuredOutput.json_schema(exact).value) == MAX_SPEC_CHARS
    with pytest.raises(InvalidParameterError, match=f"at most {MAX_SPEC_CHARS} characters"):
        StructuredOutput.json_schema({"type": "string", "description": "d" * (room + 1)})
    escaped = {"type": "string", "description": "\n" * (room // 2 + 1)}  # two characters each once written
    with pytest.raises(InvalidParameterError, match=f"at most {MAX_SPEC_CHARS} characters"):
        StructuredOutput.json_schema(escaped)


def _big_dicts() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is dict and len(o) > 10_000)


def test_a_refused_long_body_is_freed_with_its_answer(tiny_chat_model) -> None:
    """Without a garbage collection, nothing of a body refused in the worker thread (its schema of 20,000
    properties) is left once its 400 is answered; it was, every time, in a cycle through the thread's future."""
    settings = ServerSettings(api_keys=("key-one",), tenants={"key-two": Tenant("two")}, cache_isolation="api-key")
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), settings)
    tools = [{"type": "function", "function": {"name": "f", "parameters": _big(20_000)}}]
    raw = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools}).encode()
    del tools
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        gc.collect()
        before = _big_dicts()
        gc.disable()
        try:
            for key in ("key-one", "key-two", "key-one"):
                response = http.post("/v1/chat/completions", content=raw,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "tools.[0].function.parameters"
            live.wait_idle()
            # a cycle is never freed while the collector is off; a reference another thread drops a moment after
            # the answer (a loaded machine's scheduling) is: waited for, up to a few seconds
            deadline = time.monotonic() + 5
            while _big_dicts() != before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _big_dicts() == before
        finally:
            gc.enable()
