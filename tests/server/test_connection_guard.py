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


def test_a_refused_body_whose_rest_and_next_request_came_in_before_its_app_returned_is_not_a_431(
        loop: asyncio.AbstractEventLoop) -> None:
    """A body past the limit is answered 413 before it is all read; the client sent its rest, read the 413 and sent
    its next request (head and a large body) before the refused request's app returned: the bytes past the declared
    body are that request, not the rest of a skipped body nor a head begun afresh (found as a 431 for the second of
    two bodies past the limit sent one after the other on one kept-alive connection)."""
    guard, transport, inner = guarded(loop)
    first = b"{" * (ServerSettings().max_body_bytes + 100_000)
    guard.data_received(HEAD % len(first) + first[:1000])
    guard.request_started()
    guard.data_received(first[1000:])  # all of it, while the app answers 413 without reading it
    second = b"[" * 3_000_000
    guard.data_received(HEAD % len(second) + second[:1000])  # the next request, queued by the server
    guard.request_finished(True, len(first))  # the refused request's app returns, its body unread
    guard.data_received(second[1000:])  # the second's body, before its app's first step
    guard.request_started()  # ... which comes now
    loop.run_until_complete(asyncio.sleep(0))
    assert transport.written == b"" and not transport.closed
    guard.request_finished()
    assert inner.received == 2 * len(HEAD % 0) + len(str(len(first))) + len(str(len(second))) - 2 + len(first) + len(second)


def test_a_head_too_long_after_a_refused_body_is_still_a_431(loop: asyncio.AbstractEventLoop) -> None:
    guard, transport, _ = guarded(loop)
    first = b"{" * 1000
    guard.data_received(HEAD % len(first) + first)
    guard.request_started()
    guard.request_finished(True, len(first))  # answered before its body was read; all of it is in
    guard.data_received(b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 10))  # no end
    loop.run_until_complete(asyncio.sleep(0))  # no request started: it was a head
    assert b" 431 " in transport.written and b"headers_too_large" in transport.written


def test_a_request_started_before_the_refused_one_before_it_returned_counts_its_own_body_only(
        loop: asyncio.AbstractEventLoop) -> None:
    """The same two bodies, the server starting the second request's app (queued behind the first) before the first's
    app has returned: the second's body is counted from its start, not on top of the first's."""
    guard, transport, inner = guarded(loop)
    limit = ServerSettings().max_body_bytes
    first = b"{" * (limit + 100_000)
    guard.data_received(HEAD % len(first) + first[:1000])
    guard.request_started()
    guard.data_received(first[1000:])
    second = b"[" * (limit + 100_000)
    guard.data_received(HEAD % len(second) + second[:1000])
    guard.request_started()  # the second's app starts ...
    guard.request_finished(True, len(first))  # ... before the first's returns
    for at in range(1000, len(second), 65536):
        guard.data_received(second[at:at + 65536])
    loop.run_until_complete(asyncio.sleep(0))
    assert transport.written == b"" and not transport.closed
    guard.request_finished(True, len(second))  # (answered 413 by its app)
    assert inner.received == 2 * len(HEAD % len(first)) + len(first) + len(second)


def test_three_bodies_past_the_limit_whose_requests_overlap_their_predecessors_are_each_answered_by_the_app(
        loop: asyncio.AbstractEventLoop) -> None:
    """The second request's head and first bytes came in before the first's app returned (so this count gave them to
    the first), then the second was answered before its body was read: the rest the guard skips for it is longer than
    what is left of it, and runs into the third request's head; the third's body, counted as a head, is refused only
    if the server starts no request (it parsed the third's head in the same read, and starts it a turn later)."""
    guard, transport, inner = guarded(loop)
    limit = ServerSettings().max_body_bytes
    body = b"{" * (limit + 100_000)
    head = HEAD % len(body)
    guard.data_received(head + body[:1000])
    guard.request_started()
    guard.data_received(body[1000:] + head + body[:200_000])  # the first's rest, the second's head and start
    guard.request_finished(True, len(body))  # the first's app returns: all of its body is in
    guard.request_started()  # the second's app starts
    guard.data_received(body[200_000:limit + 1000])
    guard.request_finished(True, len(body))  # answered 413
    guard.data_received(body[limit + 1000:] + head + body[:300_000])  # its rest, the third's head and start
    loop.call_soon(guard.request_started)  # the task the server created as it parsed the third's head
    loop.run_until_complete(asyncio.sleep(0))
    loop.run_until_complete(asyncio.sleep(0))
    guard.data_received(body[300_000:])
    assert transport.written == b"" and not transport.closed
    guard.request_finished(True, len(body))
    assert inner.received == 3 * (len(head) + len(body))
