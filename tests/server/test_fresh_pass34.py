"""pass34: the request-head limit on a kept-alive connection's later requests (issue 25).

The connection guard answers 431 to a request line and headers past ``MAX_HEADER_BYTES`` (64 KiB) as it counts
them. After a request on the connection, though, a head it finds too long is refused only if no request starts two
turns of the loop later (the bytes may be the body of a request whose head the server had already parsed): a
too-long head that came in one read (up to 256 KiB) is parsed whole and starts its request at once, so it was served.
Only a connection's first request had the limit. The middleware now measures each started request's head from its
scope and answers 431 ``headers_too_large`` past the limit, closing the connection; a head at the limit is served.
"""

from __future__ import annotations

import re
import socket

import pytest

from asyncinfer.server.connections import MAX_HEADER_BYTES

from .conftest import LiveServer, raw_answer


def _head(size: int) -> bytes:
    """A GET of /v1/models whose request line and headers are ``size`` bytes, the blank line included."""
    start = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Fill: "
    fill = size - len(start) - len(b"\r\n\r\n")
    head = start + b"f" * fill + b"\r\n\r\n"
    assert len(head) == size
    return head


def _after_a_request(live: LiveServer, head: bytes) -> bytes:
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        first = raw_answer(sock)
        assert first.startswith(b"HTTP/1.1 200") and b"<closed>" not in first
        sock.sendall(head)  # one write: the server reads the head whole, in one piece
        return raw_answer(sock)


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1, 100 * 1024, 200 * 1024])
def test_a_head_past_the_limit_after_a_request_is_a_431(per_parser, size) -> None:
    answer = _after_a_request(per_parser, _head(size))
    if per_parser.parser == "h11" and answer.startswith(b"HTTP/1.1 400"):  # h11 refuses itself a head past
        assert b'"code":"invalid_http_request"' in answer  # its buffer (the limit) that came in pieces
        return
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"code":"headers_too_large"' in answer
    assert re.search(rb"(?i)x-request-id: \S+", answer) and answer.endswith(b"<closed>")


def test_a_head_at_the_limit_after_a_request_is_served(per_parser) -> None:
    answer = _after_a_request(per_parser, _head(MAX_HEADER_BYTES))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"<closed>" not in answer
