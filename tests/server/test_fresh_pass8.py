"""Adversarial pass 8 (a hostile tenant over HTTP): faults found on the HTTP side and fixed."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import httpx
import msgspec
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, create_app
from asyncinfer.server.errors import APIError
from asyncinfer.server.parsers import MAX_PIPELINED
from asyncinfer.server.protocol import CHAT_BODY, decode_json, parse_chat

from .conftest import TINY_OPTIONS, LiveServer


def _exchange(port: int, pieces: list[tuple[bytes, float]], timeout: float = 30) -> bytes:
    """Everything the server answers on one connection, the ``(bytes, pause after them)`` pieces sent in order
    while it is read."""
    answer: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        def read() -> None:
            try:
                while chunk := sock.recv(65536):
                    answer.append(chunk)
            except OSError:
                pass

        reader = threading.Thread(target=read)
        reader.start()
        for data, pause in pieces:
            try:
                sock.sendall(data)
            except OSError:
                break
            time.sleep(pause)
        reader.join(timeout)
    return b"".join(answer)


def _post(body: bytes, key: str = "sk-right", close: bool = False) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n").encode() + body


def _padded_body(size: int) -> bytes:
    """A short completion request of about ``size`` bytes (the bulk in ``user``, accepted and unused)."""
    return b'{"model": "tiny", "max_tokens": 1, "prompt": "hi", "user": "' + b"u" * size + b'"}'


# Pass 7 let the rest of a body answered before it was all in (a 401, a 413) count on as bytes after that request's
# head, "until the next request starts", so that it was no next head. But the count went on through the next request
# too: a client retrying with a smaller body on the same connection after a 413 (as clients do) was answered 431
# headers_too_large, its body counted with the refused one against one request's bound. And those skipped bytes still
# marked the connection as in the middle of a request: a connection left idle once the body was in got a second answer,
# "408 the request's headers did not arrive", header_timeout after the first.
@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
def test_a_retry_after_a_413_on_the_same_connection_is_served(tiny_chat_model, http_parser) -> None:
    pytest.importorskip(http_parser)
    settings = ServerSettings(api_keys=("sk-right",), max_body_bytes=256 * 1024)
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), settings)
    with LiveServer(app, settings, http=http_parser) as live:
        port = int(live.url.rsplit(":", 1)[1])
        refused = _post(_padded_body(400_000))  # over the limit: a 413 once its head is in
        answer = _exchange(port, [(refused[:300], 0.3), (refused[300:], 0.3),
                                  (_post(_padded_body(200_000), close=True), 0)])
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert statuses == [b"413", b"200"], answer[-600:]


@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
@pytest.mark.parametrize("case", ["wrong key", "too large"])
def test_a_connection_idle_after_a_refused_body_gets_no_second_answer(tiny_chat_model, http_parser, case) -> None:
    pytest.importorskip(http_parser)
    settings = ServerSettings(api_keys=("sk-right",), max_body_bytes=256 * 1024, header_timeout=1.0)
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS), settings)
    with LiveServer(app, settings, http=http_parser) as live:
        port = int(live.url.rsplit(":", 1)[1])
        request = (_post(_padded_body(200_000), key="sk-wrong") if case == "wrong key" else
                   _post(_padded_body(300_000)))
        start = time.monotonic()
        # the answer goes before the body; the body follows at once, then the connection is left idle, as a pool
        # keeps it, until the server closes it
        answer = _exchange(port, [(request[:300], 0.3), (request[300:], 0)])
        assert time.monotonic() - start < 20
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert statuses == [b"401" if case == "wrong key" else b"413"], answer[-600:]


# A message's `role` that is a list or an object (unhashable) was looked up in the table of roles as it was: a
# TypeError, answered 500 internal_error (and logged as a server fault) for a malformed body.
@pytest.mark.parametrize("role", [[], ["user"], {}, {"a": 1}])
@pytest.mark.parametrize("at", [0, 1])
def test_a_role_of_another_type_is_a_400_naming_it(role, at) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    messages[at] = {**messages[at], "role": role}
    with pytest.raises(APIError) as refused:
        parse_chat(decode_json(msgspec.json.encode({"messages": messages}), CHAT_BODY))
    assert (refused.value.status, refused.value.param) == (400, f"messages.[{at}].role"), refused.value.message


# uvicorn's httptools protocol tells only its newest request of a lost connection: a client that pipelined a
# request behind one in flight and went away left the one in flight never told (its `http.disconnect` never came),
# so it was generated to its end, stream or whole answer, for nobody, holding its KV blocks all the while; a caller
# could so make the server do any amount of work without holding a single connection.
LONG = 480  # tokens the tiny model would take about a second to decode, were it not aborted


@pytest.mark.parametrize("http_parser", ["h11", "httptools"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_with_a_request_pipelined_aborts_the_one_in_flight(tiny_chat_model, http_parser,
                                                                         stream) -> None:
    pytest.importorskip(http_parser)
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    with LiveServer(app, http=http_parser) as live:
        first = msgspec.json.encode({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": LONG,
                                     "ignore_eos": True, "stream": stream})
        second = msgspec.json.encode({"model": "tiny", "prompt": "hi", "max_tokens": 1})
        pipelined = b"".join((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(body)}\r\n\r\n").encode() + body for body in (first, second))
        before = live.engine.step_stats("tiny").decode_tokens
        with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])), timeout=30) as sock:
            sock.sendall(pipelined)
            deadline = time.monotonic() + 30
            while not live.engine.kv_stats("tiny").used_blocks:  # the first is under way
                assert time.monotonic() < deadline
                time.sleep(0.005)
        live.wait_idle()
        assert live.engine.step_stats("tiny").decode_tokens - before < LONG // 2  # aborted, not run to its end


# uvicorn's httptools protocol parses every request a read holds and queues each one behind the request in flight,
# and resumes reading whenever an answer is done: a client pipelining tiny requests (`GET /health`, 30 bytes each,
# no key needed) while reading the answers had the server parse another read's worth (about 8,000 requests) per
# request answered, each queued request kept (over a kilobyte each): 20 such connections grew the server by 900 MiB
# in 6 s, and 2 held every other caller's answers up to 2.4 s behind the parsing. Past MAX_PIPELINED requests queued, what follows is
# left unread and the connection closes once the queued ones are answered.
def test_pipelined_requests_queued_behind_one_in_flight_are_bounded(tiny_chat_model) -> None:
    pytest.importorskip("httptools")
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    with LiveServer(app, http="httptools") as live:
        queued: list[int] = []

        async def watch() -> None:  # the longest queue of any connection, while the flood lasts
            while not done.is_set():
                queued.append(max((len(getattr(p, "pipeline", ())) for p in live.server.server_state.connections),
                                  default=0))
                await asyncio.sleep(0.001)

        done = threading.Event()
        watching = asyncio.run_coroutine_threadsafe(watch(), live.engine.loop)
        flood = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 20_000
        answer = _exchange(int(live.url.rsplit(":", 1)[1]), [(flood[at:at + 65536], 0.0)
                                                             for at in range(0, len(flood), 65536)])
        done.set()
        watching.result(30)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert set(statuses) == {b"200"}, set(statuses)  # answered in order, then closed: never a 400 out of turn
    assert max(queued) <= MAX_PIPELINED, max(queued)
    # Not every answer written reaches this client: the server closes with the flood's bytes unread, the kernel
    # resets the connection, and answers not yet read here are dropped with it (1 run in 10 to 3 in 10 read fewer
    # than MAX_PIPELINED, on either side of this stop's changes); the bound above is what the test holds.
    assert 1 <= len(statuses) < 20_000


# A URL no route serves, or a method a route does not take, was echoed whole in its 404 or 405: a path of 60,000
# characters came back in a 60 KB error, where every other value a client sends is echoed elided (pass 7).
@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/" + "p" * 60_000, 404),
                                                        ("POST", "/v1/models/" + "m" * 60_000, 405)])
def test_an_unserved_url_is_echoed_bounded(tiny_chat_model, method, path, status) -> None:
    app = create_app(ModelSpec(str(tiny_chat_model), "tiny", TINY_OPTIONS))
    with LiveServer(app) as live:
        answer = httpx.request(method, live.url + path, timeout=30)
    assert answer.status_code == status and "x-request-id" in answer.headers
    assert len(answer.json()["error"]["message"]) < 1000, len(answer.text)


# A whole chat answer with tools had every choice's reply read for its calls on the serving loop: up to 64 choices
# of the context's length, hundreds of calls each (some 30 µs a call to read, check and write back: about a second
# for one answer), while every other caller's stream waited. It is built in a worker thread, as a logprobs answer is.
def test_a_whole_answer_with_tools_is_read_off_the_loop(server, monkeypatch) -> None:
    from asyncinfer.server import responses

    from .test_loop_stays_free import answered_while_held, loop_thread

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools, "n": 2,
            "max_tokens": 4})

    answer, threads = answered_while_held(server, monkeypatch, responses, "read_calls", send)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 2
    assert loop_thread(server) not in threads
