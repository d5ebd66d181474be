"""Adversarial pass 12 (a hostile caller over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import json
import re
import runpy
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import Depends, FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from asyncinfer import SamplingParams
from asyncinfer.errors import InvalidParameterError
from asyncinfer.server import ModelSpec, ServerSettings, create_app, guard_app

from .conftest import KEYS, TINY_OPTIONS, LiveServer
from .test_fresh_pass8 import _exchange

ROOT = Path(__file__).resolve().parents[2]
TEXT = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2}


def _port(live: LiveServer) -> int:
    return live.server.servers[0].sockets[0].getsockname()[1]


def _statuses(answer: bytes) -> list[bytes]:
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)


def _error_of(answer: bytes) -> tuple[dict[str, str], dict]:
    """The headers and the error body of an answer that is one error."""
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = dict(line.lower().split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:])
    return headers, json.loads(body)["error"]


# ---------------------------------------------------------------- a deployment's own routes
# A deployment's own route next to the OpenAI router (examples/openai_server.py's /haiku) ran the engine for anyone:
# the API key was checked by the router's routes only. `require_api_key(settings)` is the same check, as a FastAPI
# dependency: the same 401 (OpenAI's body, an X-Request-Id) for a missing or wrong key.
@pytest.fixture(scope="module")
def own_route(tiny_models):
    from asyncinfer.server import require_api_key

    settings = ServerSettings(api_keys=KEYS)
    app = create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)
    calls: list[str | None] = []

    @app.get("/mine")
    async def mine(request: Request, key: str | None = Depends(require_api_key(settings))) -> dict:
        calls.append(key)
        out = await request.app.state.engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        return {"tokens": len(out.token_ids)}

    with LiveServer(app, settings) as live:
        yield live, calls


def test_a_deployments_own_route_asks_for_the_key_as_the_routers_do(own_route) -> None:
    live, calls = own_route
    with httpx.Client(base_url=live.url, timeout=60) as http:
        for headers, code in [({}, None), ({"authorization": "Bearer wrong"}, "invalid_api_key"),
                              ({"authorization": "Basic key-one"}, None)]:
            mine, router = http.get("/mine", headers=headers), http.get("/v1/models", headers=headers)
            assert mine.status_code == router.status_code == 401, mine.text
            assert mine.json() == router.json()
            assert mine.json()["error"] == {"message": router.json()["error"]["message"],
                                            "type": "invalid_request_error", "param": None, "code": code}
            assert mine.headers["x-request-id"].startswith("req-")
            assert mine.headers["content-type"] == "application/json"
        assert calls == []  # the engine never ran for them
        ok = http.get("/mine", headers={"authorization": "Bearer key-two"})
        assert ok.status_code == 200 and ok.json() == {"tokens": 2}
        assert calls == ["key-two"]  # the route reads which key called


def test_without_keys_require_api_key_lets_everyone_in(tiny_models) -> None:
    from fastapi.testclient import TestClient

    from asyncinfer.server import require_api_key

    settings = ServerSettings()
    app = guard_app(FastAPI(), settings)

    @app.get("/open")
    async def open_route(key: str | None = Depends(require_api_key(settings))) -> dict:
        return {"key": key}

    with TestClient(app) as http:
        assert http.get("/open", headers={"authorization": "Bearer anything"}).json() == {"key": None}


def test_the_example_servers_own_route_asks_for_the_key(monkeypatch) -> None:
    """examples/openai_server.py's /haiku, with ASYNCINFER_API_KEY set: a 401 without the key (it ran the engine)."""
    from fastapi.testclient import TestClient

    monkeypatch.setenv("ASYNCINFER_API_KEY", "sk-example")
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    monkeypatch.setattr(sys, "argv", ["openai_server.py"])
    example = runpy.run_path(str(ROOT / "examples" / "openai_server.py"), run_name="example")

    prompts: list = []

    class Engine:  # what the lifespan would load: the route's calls of it, recorded
        async def generate(self, prompt, params):
            prompts.append(prompt)
            return type("Out", (), {"text": "an old pond"})()

    example["haiku"].__globals__["engine"] = Engine()
    http = TestClient(example["app"])  # not entered: no lifespan, no model
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = http.get("/haiku", headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.headers["x-request-id"]
    assert prompts == []
    r = http.get("/haiku", params={"topic": "rain"}, headers={"authorization": "Bearer sk-example"})
    assert r.status_code == 200 and r.json() == {"haiku": "an old pond"}
    assert prompts == [[{"role": "user", "content": "A haiku about rain."}]]


# ---------------------------------------------------------------- duplicate headers
# A header a decision reads, given twice, is a 400 `duplicate_header`. That check ran before the key's: a caller
# without a key was told which headers the server reads (a 400 naming the tenant header, where the key's 401 was
# due), and two wrong keys were a 400, not a 401. And it ran for the tenant header on every server and route, read
# or not: a client (or a proxy) sending `X-Tenant-Id` twice to a server that never reads it was refused. Now the key
# is checked first, and each header only where it is read.
@pytest.mark.parametrize("copies", [
    [("x-team", "vip"), ("X-Team", "bob")],
    [("x-priority", "-9"), ("x-priority", "5")],
    [("content-type", "application/json"), ("content-type", "text/plain")],
    [("authorization", "Bearer wrong"), ("authorization", "Bearer also-wrong")],
    [("authorization", "Bearer wrong"), ("authorization", "Basic key-one")],
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/nope"])
def test_without_an_accepted_key_a_duplicate_header_is_a_401(trusting, copies, path) -> None:
    """A caller without an accepted key learns nothing but the 401: not which headers the server reads."""
    got_key = any(name == "authorization" and value.startswith("Bearer ") for name, value in copies)
    with httpx.Client(base_url=trusting.url) as http:
        r = http.post(path, headers=copies, content=json.dumps(TEXT))
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == ("invalid_api_key" if got_key else None)
        assert r.headers["x-request-id"]


@pytest.mark.parametrize("copies", [
    [("authorization", "Bearer key-one"), ("x-team", "vip"), ("X-Team", "bob")],
    [("authorization", "Bearer wrong"), ("authorization", "Bearer key-one")],
])
def test_with_an_accepted_key_a_duplicate_header_is_still_a_400(trusting, copies) -> None:
    with httpx.Client(base_url=trusting.url) as http:
        r = http.post("/v1/completions", headers=copies, content=json.dumps(TEXT))
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], copies[-1][0].lower() in r.json()["error"]["message"]) == (
            "duplicate_header", True)


def test_a_header_is_checked_only_where_it_is_read(server, trusting) -> None:
    # the default settings read no tenant header: sent twice, it changes nothing
    tenant_twice = [("x-tenant-id", "a"), ("x-tenant-id", "b")]
    body = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", headers=tenant_twice, json=body, timeout=60)
    assert r.status_code == 200, r.text
    # nor an Authorization header on a server without keys
    r = httpx.post(server.url + "/v1/completions", headers=[("authorization", "Bearer a"), ("authorization", "b")],
                   json=body, timeout=60)
    assert r.status_code == 200, r.text
    # a server that reads the tenant and priority headers reads them on generation routes only
    key = [("authorization", "Bearer key-one")]
    with httpx.Client(base_url=trusting.url, timeout=60) as http:
        for extra in ([("x-team", "a"), ("x-team", "b")], [("x-priority", "1"), ("x-priority", "2")],
                      [("x-team", "")]):
            r = http.get("/v1/models", headers=key + extra)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "ids", r.text
        r = http.get("/v1/models", headers=key + [("content-type", "a/b"), ("content-type", "c/d")])
        assert r.status_code == 200, r.text  # no body read: its type is not read either


# ---------------------------------------------------------------- request framing
def _echo_app() -> tuple[FastAPI, list[bytes]]:
    """A guarded app whose POST /echo answers the body it read; the bodies, recorded."""
    bodies: list[bytes] = []
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:  # its connection closed: nobody reads an answer
            return Response(status_code=499)
        bodies.append(body)
        return JSONResponse({"got": body.decode("latin-1")})

    return guard_app(app), bodies


SMUGGLED = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
CHUNKED_EMPTY = b"0\r\n\r\n"


# A request with both Content-Length and Transfer-Encoding is framed two ways: a proxy that reads one and a server
# that reads the other disagree on where it ends, and what one takes for its body the other serves as a request of its
# own (smuggled past the proxy). httptools refuses such a request; h11 took it and read its chunks, serving it. Now both
# refuse it with a 400 in OpenAI's shape, and the connection closes: nothing after its head is read.
@pytest.mark.parametrize("protocol", ["h11", "httptools"])
@pytest.mark.parametrize("headers", [
    b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n",
    b"Content-Length: %d\r\nTransfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
])
def test_a_request_framed_by_both_content_length_and_transfer_encoding_is_refused(protocol, headers) -> None:
    app, bodies = _echo_app()
    body = CHUNKED_EMPTY + SMUGGLED  # chunked: an empty body, then a request; by its length: one body
    raw = b"POST /echo HTTP/1.1\r\nHost: x\r\n" + headers % len(body) + b"\r\n" + body
    with LiveServer(app, http=protocol) as live:
        start = time.monotonic()
        answer = _exchange(_port(live), [(raw, 0)], timeout=20)
        assert time.monotonic() - start < 5  # refused, closed: not left to a timeout
        assert _statuses(answer) == [b"400"], answer
        headers_of, error = _error_of(answer)
        assert headers_of["connection"] == "close" and headers_of["x-request-id"].startswith("conn-")
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_http_request", None)
        assert bodies == []  # no app ran: neither the request nor the one in its body
        assert httpx.post(live.url + "/echo", content=b"ok").json() == {"got": "ok"}  # the server serves on


# A chunked body that is not valid chunked coding (a chunk size that is no hex number, a chunk longer than its size)
# is refused by httptools' parser, but uvicorn's protocol took that for bytes behind a request in flight and kept the
# connection, reading nothing more, until the request in flight (the very one whose body broke) was answered: its app
# waited for the rest of its body until the body deadline (30 s), then a 408. Now the request is refused at once: a 400
# in OpenAI's shape, the connection closed; one pipelined behind an answered request is refused after that answer.
MALFORMED_CHUNKS = [b"zz\r\nhello\r\n0\r\n\r\n", b"5\r\nhelloXX\r\n0\r\n\r\n", b"-1\r\n\r\n"]


@pytest.mark.parametrize("protocol", ["h11", "httptools"])
@pytest.mark.parametrize("chunks", MALFORMED_CHUNKS)
def test_a_malformed_chunked_body_is_refused_at_once(protocol, chunks) -> None:
    app, bodies = _echo_app()
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    good = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok"
    with LiveServer(app, http=protocol) as live:
        for pieces, statuses in [([(head + chunks, 0)], [b"400"]),
                                 ([(head, 0.2), (chunks, 0)], [b"400"]),  # the body after the app has started
                                 ([(good + head + chunks, 0)], [b"200", b"400"])]:  # pipelined behind a request
            start = time.monotonic()
            answer = _exchange(_port(live), pieces, timeout=20)
            assert time.monotonic() - start < 5, (pieces, answer)  # the body deadline is 30 s
            assert _statuses(answer) == statuses, answer
            _headers, error = _error_of(answer[answer.rindex(b"HTTP/1.1 400"):])
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_http_request")
        assert bodies == [b"ok"]  # the good request only


# ---------------------------------------------------------------- Ray Serve's builder
# `serve run asyncinfer.serve_ray:build model=... api_keys=sk-one,sk-two` gives every argument as text, and the builder
# made a tuple of it: a key per character ("s", "k", "-", ...), so any one-character bearer token got in. Text is now
# keys separated by commas (blank, or with an empty item, refused), as ASYNCINFER_API_KEY is read; a list (a config
# file's YAML list) is taken as it is.
def test_ray_serves_api_keys_text_is_split_on_commas() -> None:
    pytest.importorskip("ray")
    from asyncinfer.serve_ray import _server_settings

    for given, keys in [("sk-one", ("sk-one",)), ("sk-one, sk-two", ("sk-one", "sk-two")), (" k1 ,k2 ", ("k1", "k2")),
                        (["sk-one", "sk-two"], ("sk-one", "sk-two")), (("k",), ("k",)), ([], ()), (None, ())]:
        settings = _server_settings({} if given is None else {"api_keys": given})
        assert settings.api_keys == keys, given
        assert settings.accepted_keys == keys
    assert "s" not in _server_settings({"api_keys": "sk-one"}).accepted_keys
    for bad in ("", " ", ",", "sk-one,,sk-two", "sk-one,", 7, ["sk-one", ""], ["sk-one", 3]):
        with pytest.raises(InvalidParameterError) as refused:
            _server_settings({"api_keys": bad})
        assert refused.value.parameter == "api_keys", bad
    assert _server_settings({"api_keys": "a,b", "cache_isolation": "api-key"}).cache_isolation == "api-key"


def test_ray_serves_builder_refuses_api_keys_text_with_an_empty_key_before_deploying() -> None:
    pytest.importorskip("ray")
    from asyncinfer.serve_ray import build

    for bad in ("sk-one,", ""):  # were the keys "s", "k", "-", "o", "n", "e", ","; and no key at all
        with pytest.raises(InvalidParameterError) as refused:
            build({"model": "/models/llama", "api_keys": bad})
        assert refused.value.parameter == "api_keys"
