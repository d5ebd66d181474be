"""pass35: the request-head limit on a kept-alive connection's later requests, measured on the wire (issue 25).

pass34 made the middleware answer 431 to a started request whose head, measured from its scope, passes
``MAX_HEADER_BYTES``: the guard leaves a head it finds too long after a request to the server (the bytes may be a
body), and one that came whole in one read was parsed and served. The scope keeps no optional whitespace, though: a
head of 70 KB on the wire, 40 KB of it spaces before a header's value, was answered 431 as a connection's first request
and served as its second. The guard now tells the middleware when the bytes it found too long began as a request's
head does, and the request started from them is answered 431 ``headers_too_large``; a body that passed the count as
the "next head" (the case the guard waits for) is still read as a body.

And a request pipelined behind another, only its first bytes sent, was closed as an idle connection when the header
deadline passed, without the 408 a request begun alone gets: those bytes came while the first was in flight, and the
guard counted them as that request's. Bytes past its declared body (more than the CRLF some clients add) are a
request begun now.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import pytest

from asyncinfer.server import ModelSpec, create_app
from asyncinfer.server.connections import MAX_HEADER_BYTES

from .conftest import TINY_OPTIONS, LiveServer, raw_answer


def _padded_head(size: int) -> bytes:
    """A GET of /v1/models of ``size`` bytes on the wire, most of them spaces before a header's value (which the
    parsers drop: its scope holds a head of some 30 KB)."""
    start = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Fill:"
    value = b"v" * 30_000 + b"\r\n\r\n"
    head = start + b" " * (size - len(start) - len(value)) + value
    assert len(head) == size
    return head


def _send(live: LiveServer, head: bytes, *, later: bool) -> bytes:
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        if later:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            first = raw_answer(sock)
            assert first.startswith(b"HTTP/1.1 200") and b"<closed>" not in first
        sock.sendall(head)  # one write: the server reads the head whole, in one piece
        return raw_answer(sock)


@pytest.mark.parametrize("later", [False, True], ids=["first", "later"])
@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1, 70_000, 200 * 1024])
def test_a_head_past_the_limit_with_whitespace_is_a_431_on_any_request(per_parser, size, later) -> None:
    answer = _send(per_parser, _padded_head(size), later=later)
    if per_parser.parser == "h11" and answer.startswith(b"HTTP/1.1 400"):  # h11 refuses itself a head past its buffer
        assert b'"code":"invalid_http_request"' in answer  # (the limit) that came in pieces
        return
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"code":"headers_too_large"' in answer
    assert re.search(rb"(?i)x-request-id: \S+", answer) and answer.endswith(b"<closed>")


@pytest.mark.parametrize("later", [False, True], ids=["first", "later"])
def test_a_padded_head_at_the_limit_is_served(per_parser, later) -> None:
    answer = _send(per_parser, _padded_head(MAX_HEADER_BYTES), later=later)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"<closed>" not in answer


@pytest.mark.parametrize("start", [b"GET /v1/models", b"\r\nGET http://x/v1/models", b"OPTIONS *"])
def test_the_guard_tells_a_too_long_head_from_a_body_by_its_start(start: bytes) -> None:
    from .test_connection_guard import HEAD, guarded

    loop = asyncio.new_event_loop()
    try:
        for data, is_head in ((start + b" HTTP/1.1\r\nX-Fill:" + b" " * MAX_HEADER_BYTES + b"v\r\n\r\n", True),
                              (b'{"prompt": "' + b"a" * MAX_HEADER_BYTES + b'"}', False),
                              (b"hello world " * 10_000, False)):
            guard, _, _ = guarded(loop)
            guard.data_received(HEAD % 10 + b"0123456789")
            guard.request_started()
            guard.request_finished()
            guard.data_received(data)  # found too long: a head the server parsed whole, or a body it had a head for
            assert guard.request_started() is is_head  # the request those bytes start, or the one they are the body of
    finally:
        loop.close()


def test_a_pipelined_request_whose_head_is_not_all_in_gets_its_408(tiny_models) -> None:
    """A request sent behind another in one write, only its first bytes: the connection was closed as an idle one
    when the header deadline passed, with no answer, where a request begun alone gets its 408."""
    from asyncinfer.server import ServerSettings

    settings = ServerSettings(header_timeout=1.0)
    app = create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings)
    body = b'{"model": "ids", "prompt": [1, 2, 3], "max_tokens": 2}'
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    for parser in ("httptools", "h11"):
        with LiveServer(app, settings, http=parser) as live:
            port = int(live.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(request + b"POST /v1/com")
                answer = _until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            assert b"HTTP/1.1 408" in answer and b'"code":"request_timeout"' in answer, answer[-300:]
            with socket.create_connection(("127.0.0.1", port)) as sock:  # a request then nothing: closed, no 408
                sock.sendall(request)
                answer = _until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" not in answer, answer[-300:]


def _until_closed(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not piece:
            break
        data += piece
    return data
