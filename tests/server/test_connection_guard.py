"""The connection guard's head limit across a keep-alive connection's requests (issue 25).

Under load the full suite once answered a keep-alive client's 200 KB request 431 headers_too_large: the
server had parsed that request's head, queued behind the previous request, while the previous request's app
was still finishing; the guard then counted the head of "the next request" afresh, from bytes that were
already that request's body. A head found too long right after a request finishes is now refused only if
no request has started by the loop's next turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from asyncinfer.server.connections import MAX_HEADER_BYTES, ConnectionGuard
from asyncinfer.server.settings import ServerSettings


class Inner(asyncio.Protocol):
    def __init__(self) -> None:
        self.received = 0

    def data_received(self, data: bytes) -> None:
        self.received += len(data)


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def guarded(loop: asyncio.AbstractEventLoop) -> tuple[ConnectionGuard, Transport, Inner]:
    inner, transport = Inner(), Transport()
    guard = ConnectionGuard(inner, set(), ServerSettings(), loop)
    guard.connection_made(transport)
    return guard, transport, inner


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"


def test_a_body_whose_head_the_server_parsed_before_the_previous_request_ended_is_not_a_431(
        loop: asyncio.AbstractEventLoop) -> None:
    guard, transport, inner = guarded(loop)
    guard.data_received(HEAD % 10 + b"0123456789")
    guard.request_started()  # the first request runs
    body = b"[" * 200_000
    guard.data_received(HEAD % len(body) + body[:1000])  # the next one's head, queued by the server
    guard.request_finished()  # the first request's app returns
    guard.data_received(body[1000:])  # the second's body arrives before its app's first step
    guard.request_started()  # ... which comes now
    loop.run_until_complete(asyncio.sleep(0))
    assert transport.written == b"" and not transport.closed
    assert inner.received == len(HEAD % 10) + 10 + len(HEAD % len(body)) + len(body)


def test_a_head_too_long_after_a_request_ends_is_still_a_431(loop: asyncio.AbstractEventLoop) -> None:
    guard, transport, _ = guarded(loop)
    guard.data_received(HEAD % 10 + b"0123456789")
    guard.request_started()
    guard.request_finished()
    guard.data_received(b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 10))  # no end
    loop.run_until_complete(asyncio.sleep(0))  # no request started: it was a head
    assert b" 431 " in transport.written and b"headers_too_large" in transport.written


def test_a_head_too_long_on_a_new_connection_is_refused_at_once(loop: asyncio.AbstractEventLoop) -> None:
    guard, transport, inner = guarded(loop)
    guard.data_received(b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 10))
    assert b" 431 " in transport.written and inner.received == 0
