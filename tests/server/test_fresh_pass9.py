"""Adversarial pass 9 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import socket
import time

import httpx
import msgspec
import pytest
from fastapi import FastAPI, WebSocket

from asyncinfer.outputs import StreamDelta
from asyncinfer.server import ModelSpec, create_app

from .conftest import TINY_OPTIONS, LiveServer

# A stream's reader takes one delta of each sample at a time (pass 8): a client that reads its answer slowly leaves the
# rest in the engine's stream, which merges them, so that the next delta holds everything generated meanwhile, up to
# the context's length. With tools, each delta is read for its calls on the serving loop: a merged delta of a long
# context (130,000 characters of calls: some 40 ms; 64 choices, each its own delta) held every other caller's answers
# meanwhile. A delta longer than the loop's share is read in a worker thread, as a whole answer's calls are.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'


def test_a_long_streamed_delta_with_tools_is_read_off_the_loop(server, monkeypatch) -> None:
    from asyncinfer.server import tools

    from .test_loop_stays_free import answered_while_held, loop_thread

    engine = server.engine
    real = engine.stream

    def merged(*args, **kwargs):  # as the engine's stream merges the pieces of a reader that fell behind
        async def pieces():
            deltas = [delta async for delta in real(*args, **kwargs)]
            yield StreamDelta(deltas[-1].request_id, CALL * 200, [t for d in deltas for t in d.token_ids],
                              deltas[-1].finish_reason)
        return pieces()

    monkeypatch.setattr(engine, "stream", merged)
    function = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": function,
            "max_tokens": 4, "stream": True})

    answer, threads = answered_while_held(server, monkeypatch, tools.CallStream, "feed", send)
    assert answer.status_code == 200, answer.text
    events = [msgspec.json.decode(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: {")]
    calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls", ())]
    assert len({c["index"] for c in calls}) == 200
    assert loop_thread(server) not in threads


# Pass 8 cut the URL a 404 or a 405 echoes past 256 characters; the OpenAI 403 of a refused WebSocket handshake still
# echoed its path whole (up to the WebSocket library's 8 KiB request line: 7,000 characters came back).
@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
def test_a_refused_websocket_handshake_echoes_its_path_bounded(http_parser) -> None:
    from asyncinfer.server import guard_app

    from .test_fresh_pass8 import _exchange

    pytest.importorskip(http_parser)
    pytest.importorskip("websockets")  # uvicorn hands the upgrade to it (without one, it is plain HTTP)
    handshake = (b"GET /v1/" + b"p" * 7_000 + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    with LiveServer(guard_app(FastAPI()), http=http_parser) as live:
        answer = _exchange(int(live.url.rsplit(":", 1)[1]), [(handshake, 0.5)])
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403") and b"x-request-id" in head.lower(), head
    error = msgspec.json.decode(body)["error"]
    assert error["code"] == "websocket_refused" and len(error["message"]) < 1000, len(error["message"])


# A handshake the WebSocket library refuses itself, before any app runs (a missing Sec-WebSocket-Key, a request line or
# headers past its limits: any request with `Upgrade: websocket` on any URL), was answered in the library's words: a
# text/plain 400, 414 or 431 without an X-Request-Id.
_UPGRADE = b"GET /v1/x HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
_KEY = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"


@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
@pytest.mark.parametrize(("handshake", "status"), [
    (_UPGRADE + b"Sec-WebSocket-Version: 13\r\n\r\n", 400),
    (_UPGRADE.replace(b"/v1/x", b"/v1/" + b"p" * 9000) + _KEY + b"\r\n", 414),
    (_UPGRADE + b"a: b\r\n" * 300 + _KEY + b"\r\n", 431)], ids=["no key", "long line", "many headers"])
def test_a_handshake_the_websocket_library_refuses_is_answered_in_openai_shape(http_parser, handshake, status) -> None:
    from asyncinfer.server import guard_app

    from .test_fresh_pass8 import _exchange

    pytest.importorskip(http_parser)
    pytest.importorskip("websockets")
    with LiveServer(guard_app(FastAPI()), http=http_parser) as live:
        answer = _exchange(int(live.url.rsplit(":", 1)[1]), [(handshake, 0.5)])
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), head
    assert b"content-type: application/json" in head.lower() and b"x-request-id: conn-" in head.lower(), head
    error = msgspec.json.decode(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_websocket_handshake"), error


def _echo_app() -> FastAPI:
    """An app whose WebSocket route ``/echo`` answers every text with it twice, until the client goes."""
    app = FastAPI()

    @app.websocket("/echo")
    async def echo(socket: WebSocket) -> None:
        await socket.accept()
        while True:
            await socket.send_text((await socket.receive_text()) * 2)

    return app


@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
def test_an_accepted_websocket_still_talks(http_parser) -> None:
    from asyncinfer.server import guard_app

    pytest.importorskip(http_parser)
    connect = pytest.importorskip("websockets.sync.client").connect
    with LiveServer(guard_app(_echo_app()), http=http_parser) as live, connect(live.url.replace("http", "ws") + "/echo") as ws:
        ws.send("ab")
        assert ws.recv(timeout=10) == "abab"


# The connection guard's header deadline, armed when a connection opens, was never told of a WebSocket handshake (the
# guard learns of HTTP requests only): header_timeout after it, it wrote its HTTP 408 into the accepted WebSocket's
# frames (the client: "reserved bits must be 0") and closed it. A WebSocket is in flight for the guard while it lasts.
@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
def test_an_accepted_websocket_outlives_the_header_deadline(http_parser) -> None:
    from asyncinfer.server import ServerSettings, guard_app

    pytest.importorskip(http_parser)
    connect = pytest.importorskip("websockets.sync.client").connect
    settings = ServerSettings(header_timeout=0.5)
    with LiveServer(guard_app(_echo_app(), settings), settings, http=http_parser) as live, \
            connect(live.url.replace("http", "ws") + "/echo") as ws:
        for _ in range(4):
            ws.send("ab")
            assert ws.recv(timeout=10) == "abab"
            time.sleep(0.4)


# Under httptools, a WebSocket handshake pipelined behind a request in flight was handed the connection at once
# (uvicorn switches the transport to the WebSocket protocol as soon as it parses the handshake): the request in flight
# then never heard of the connection's end, and a whole answer was generated to its end for a client gone (the pass-8
# fault, by another way). The handshake is left unread, as a request past MAX_PIPELINED.
LONG = 480  # tokens the tiny model would take about a second to decode, were it not aborted
_HANDSHAKE = _UPGRADE + _KEY + b"\r\n"


def _long_request(stream: bool, max_tokens: int = LONG) -> bytes:
    body = msgspec.json.encode({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": max_tokens,
                                "ignore_eos": True, "stream": stream})
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_with_a_handshake_pipelined_aborts_the_request_in_flight(tiny_chat_model, http_parser,
                                                                                stream) -> None:
    pytest.importorskip(http_parser)
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    with LiveServer(app, http=http_parser) as live:
        before = live.engine.step_stats("tiny").decode_tokens
        with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(_long_request(stream) + _HANDSHAKE)
            deadline = time.monotonic() + 30
            while not live.engine.kv_stats("tiny").used_blocks:  # the first is under way
                assert time.monotonic() < deadline
                time.sleep(0.005)
        live.wait_idle()
        assert live.engine.step_stats("tiny").decode_tokens - before < LONG // 2  # aborted, not run to its end


@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
def test_the_request_before_a_pipelined_handshake_is_answered(tiny_chat_model, http_parser) -> None:
    from .test_fresh_pass8 import _exchange

    pytest.importorskip(http_parser)
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    with LiveServer(app, http=http_parser) as live:
        answer = _exchange(int(live.url.rsplit(":", 1)[1]), [(_long_request(False, 4) + _HANDSHAKE, 0)])
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
