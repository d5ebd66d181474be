"""uvicorn's HTTP/1.1 protocols, answering a request they cannot parse in OpenAI's shape.

uvicorn's parsers (h11, httptools) answer bytes that are not an HTTP/1.1 request (a malformed
header, a ``Content-Length`` that is no number, TLS spoken to the plain port) themselves, before any
app runs, with a ``text/plain`` 400. The protocols here are uvicorn's with that one answer replaced:
a 400 ``invalid_http_request`` with an OpenAI error body and an ``X-Request-Id``, then the connection
closes, as uvicorn closes it. Likewise the answer of uvicorn's WebSocket library to a handshake it refuses
itself (a missing or malformed ``Sec-WebSocket-Key``, a request line or headers past its limits), before
any app runs: its status in OpenAI's shape (``invalid_websocket_handshake``).
"""

from __future__ import annotations

import asyncio
import functools
import http
from typing import Any

from asyncinfer.errors import InvalidParameterError
from asyncinfer.server.errors import APIError, elided, new_request_id

HTTP_PROTOCOLS = ("auto", "h11", "httptools")
#: Requests pipelined on one connection that may wait behind the one in flight (httptools; h11 reads one request at
#: a time). Past them, what the client sends is left unread, and the connection closes once they are answered.
MAX_PIPELINED = 32


class _PipelineFull(Exception):
    """Raised in the parser's callback to stop it: the request it was reading would queue past MAX_PIPELINED."""


def http_protocol(name: str) -> type[asyncio.Protocol]:
    """uvicorn's protocol ``name`` ("auto": httptools where installed, else h11, as uvicorn chooses)."""
    if name not in HTTP_PROTOCOLS:
        raise InvalidParameterError("http", name, f"one of {HTTP_PROTOCOLS}")
    if name == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            name = "h11"
        else:
            name = "httptools"
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11(H11Protocol):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                if self.ws_protocol_class is not None:
                    self.ws_protocol_class = _openai_handshakes(self.ws_protocol_class)

            def send_400_response(self, msg: str) -> None:
                _refuse(self.transport)

        return H11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpTools(HttpToolsProtocol):
        """uvicorn's httptools protocol, its 400 in OpenAI's shape, and:

        - a lost connection told to every request of it: uvicorn tells only its newest (a request pipelined
          behind the one in flight), so the one in flight never heard of it and was answered to its end for
          nobody (its generation never aborted);
        - a WebSocket handshake pipelined behind a request in flight left unread (uvicorn handed the connection to
          the WebSocket at once, and the request in flight never heard of the connection's end);
        - at most :data:`MAX_PIPELINED` requests queued behind the one in flight: uvicorn parsed and queued every
          request of each read, and read again whenever an answer was done, so a client pipelining tiny requests
          grew the queue by thousands per answer (memory, and parsing that held every other caller's answers).
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.ws_protocol_class is not None:
                self.ws_protocol_class = _openai_handshakes(self.ws_protocol_class)
            self.unanswered: list[Any] = []  # the connection's requests (uvicorn's cycles) not yet answered
            self.pipeline_full = False  # what follows the queued requests is left unread

        def data_received(self, data: bytes) -> None:
            if not self.pipeline_full:
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            if self.pipeline_full:  # the parser stopped at _PipelineFull: nothing unparsable, nothing to answer
                return
            _refuse(self.transport)

        def on_headers_complete(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete and len(self.pipeline) >= MAX_PIPELINED:
                self.pipeline_full = True
                self.flow.pause_reading()
                self.pipeline[0][0].keep_alive = False  # the newest queued: its answer says close, then closes
                raise _PipelineFull
            super().on_headers_complete()
            self.unanswered = [c for c in self.unanswered if not c.response_complete]
            if self.cycle is not None and not any(c is self.cycle for c in self.unanswered):
                self.unanswered.append(self.cycle)

        def handle_websocket_upgrade(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                # a handshake pipelined behind a request in flight: uvicorn handed the connection to the WebSocket
                # then and there, and the request in flight never heard of its end (generated to its end for a
                # client gone). Left unread instead, as a request past MAX_PIPELINED: the connection closes once
                # the requests before it are answered.
                self.pipeline_full = True
                self.flow.pause_reading()
                (self.pipeline[0][0] if self.pipeline else self.cycle).keep_alive = False
                return
            super().handle_websocket_upgrade()

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            for cycle in self.unanswered:
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()

    return HttpTools


def _refuse(transport: asyncio.Transport) -> None:
    """What uvicorn's ``send_400_response`` does (its ``msg`` is always "Invalid HTTP request received."),
    in OpenAI's shape."""
    error = APIError(400, "The request is not valid HTTP/1.1: the server could not parse its request line or "
                          "headers.", code="invalid_http_request")
    transport.write(error.raw_response(new_request_id("conn")))
    transport.close()


@functools.cache
def _openai_handshakes(protocol: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """uvicorn's WebSocket protocol ``protocol``, its first write (the handshake's answer) in OpenAI's shape when it
    is the library's own refusal (a ``text/plain`` 400, 414 or 431, without an ``X-Request-Id``)."""

    class OpenAIHandshakes(protocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(_HandshakeTransport(transport))  # type: ignore[arg-type]

    return OpenAIHandshakes


class _HandshakeTransport:
    """A connection's transport as its WebSocket protocol sees it: the same, but for its first write."""

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._answered = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._answered:
            self._answered = True
            data = _handshake_answer(bytes(data))
        self._transport.write(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _handshake_answer(data: bytes) -> bytes:
    """``data``, a WebSocket handshake's answer, as it is when it accepts (101) or already has an ``X-Request-Id`` (the
    app's refusal, see ``connections._websocket_refusal``); otherwise in OpenAI's shape, with the library's reason."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit() or not 400 <= int(parts[1]) < 600:
        return data
    if any(line.lower().startswith(b"x-request-id:") for line in lines[1:]):
        return data
    status = int(parts[1])
    reason = body.decode("utf-8", "replace").strip().removeprefix("Failed to open a WebSocket connection: ")
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "refused"
    error = APIError(status, f"The WebSocket handshake was refused ({status} {phrase}): {elided(reason)}",
                     type="invalid_request_error" if status < 500 else "server_error",
                     code="invalid_websocket_handshake" if status < 500 else "internal_error")
    return error.raw_response(new_request_id("conn"))
