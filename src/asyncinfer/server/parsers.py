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


#: h11's events (a request's head, a piece of a chunked body) handled in one turn of the loop (h11 only: httptools
#: parses in C, its callbacks a few times cheaper).
H11_EVENTS_PER_TURN = 512

#: The key of an ASGI scope whose request's body the server did not read (a chunked body of a request that asked for
#: an upgrade, see ``HttpTools._not_upgraded``): its app is not run, and it is answered 400 ``unsupported_upgrade``.
UNREAD_BODY = "asyncinfer.unread_body"


class _PipelineFull(Exception):
    """Raised in the parser's callback to stop it: the request it was reading would queue past MAX_PIPELINED."""


def http_protocol(name: str) -> type[asyncio.Protocol]:
    """uvicorn's protocol ``name`` ("auto": httptools where installed, else h11, as uvicorn chooses)."""
    if name not in HTTP_PROTOCOLS:
        raise InvalidParameterError("http", name, f"one of {HTTP_PROTOCOLS}")
    if name == "auto":
        try:
            import httptools
        except ImportError:
            name = "h11"
        else:
            name = "httptools"
    if name == "h11":
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11(H11Protocol):
            """uvicorn's h11 protocol, its 400 in OpenAI's shape, handling at most :data:`H11_EVENTS_PER_TURN` of h11's
            events (a request's head, a piece of its body) in one turn of the loop; the rest is handled in the next
            turns. uvicorn handled all that one read held at once: a body sent in chunks of one byte is an event a
            byte, each some 16 microseconds of Python, so a read of them held the loop (every other caller's answers)
            for seconds. A request with both a ``Content-Length`` and a ``Transfer-Encoding``, which h11 reads as
            chunked, is refused with that 400 before any app runs (:func:`_framed_twice`), as httptools refuses it."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                if self.ws_protocol_class is not None:
                    self.ws_protocol_class = _openai_handshakes(self.ws_protocol_class)
                self.events_left = H11_EVENTS_PER_TURN
                self.more_events: asyncio.Handle | None = None  # the next turn's handling, when one is due
                self.refusal: APIError | None = None  # why the next 400 refuses the request, when not the default
                parse = self.conn.next_event

                def next_event() -> Any:  # what uvicorn's handle_events reads the connection's events with
                    if self.events_left <= 0:  # this turn's share handled: the rest in the next turn
                        if self.more_events is None:
                            self.more_events = self.loop.call_soon(self._handle_more_events)
                        return h11.NEED_DATA
                    self.events_left -= 1
                    event = parse()
                    if isinstance(event, h11.Request) and _framed_twice(event.headers):
                        # h11 reads such a body as chunked (RFC 9112 lets a server do so, if it closes after): refused
                        # instead, before any app runs, as httptools refuses it
                        self.refusal = _framing_error()
                        raise h11.RemoteProtocolError("Content-Length and Transfer-Encoding", 400)
                    return event

                self.conn.next_event = next_event  # type: ignore[method-assign]

            def data_received(self, data: bytes) -> None:
                self.events_left = H11_EVENTS_PER_TURN
                super().data_received(data)

            def on_response_complete(self) -> None:
                self.events_left = H11_EVENTS_PER_TURN
                super().on_response_complete()

            def _handle_more_events(self) -> None:
                self.more_events = None
                if not self.transport.is_closing():
                    self.events_left = H11_EVENTS_PER_TURN
                    self.handle_events()

            def send_400_response(self, msg: str) -> None:
                body = self.refusal is None and self.conn.their_state is h11.SEND_BODY
                _refuse(self.transport, _malformed_body_error() if body else self.refusal)

        return H11
    import httptools
    from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
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
          grew the queue by thousands per answer (memory, and parsing that held every other caller's answers);
        - a request asking for an upgrade uvicorn does not make (``Upgrade: h2c``) read as plain HTTP, its body
          included, and a ``CONNECT``'s bytes never parsed as requests (:meth:`_not_upgraded`);
        - bytes it cannot parse, behind requests not yet answered, refused after their answers (uvicorn's 400 went
          out at once, as the answer of the request in flight, which was never answered);
        - a request whose own body it cannot parse (malformed chunked coding) refused at once, or, queued behind
          requests not yet answered, never run and refused after their answers (taken for bytes behind the request
          in flight, it waited for the rest of its body until the body deadline: :meth:`_refuse_body`).
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.ws_protocol_class is not None:
                self.ws_protocol_class = _openai_handshakes(self.ws_protocol_class)
            self.unanswered: list[Any] = []  # the connection's requests (uvicorn's cycles) not yet answered
            self.pipeline_full = False  # what follows the queued requests is left unread
            self.refuse_pending = False  # unparsable bytes came behind requests in flight: a 400 after their answers
            self.owed = 0  # bytes of a body the parser skipped (see _not_upgraded) still to come
            self.owed_cycle: Any = None  # the request they are for
            self.refusal: APIError | None = None  # why the pending 400 refuses, when not the default

        def data_received(self, data: bytes) -> None:
            while data and not self.pipeline_full:
                if self.owed:  # the body of a request whose head asked for an upgrade, which the parser skipped
                    data = self._owed_body(data)
                    if not data:
                        return
                # uvicorn's, but for an upgrade it does not make (any but a WebSocket's): read as the plain request it is
                self._unset_keepalive_if_required()
                try:
                    self.parser.feed_data(data)
                    return
                except httptools.HttpParserError:
                    self.logger.warning("Invalid HTTP request received.")
                    self.send_400_response("Invalid HTTP request received.")
                    return
                except httptools.HttpParserUpgrade as upgrade:
                    if self._should_upgrade():
                        self.handle_websocket_upgrade()
                        return
                    data = self._not_upgraded(data[upgrade.args[0] :])

        def _not_upgraded(self, rest: bytes) -> bytes:
            """The request just parsed asked for an upgrade (``Upgrade`` and ``Connection: upgrade``, say ``h2c``),
            or was a ``CONNECT``: the parser ended its message with its head, skipping its body, and stopped there,
            ``rest`` (what followed in the same read) unparsed, as the other protocol's. uvicorn dropped ``rest``
            and parsed the next read as a new request: the body of ``POST`` with ``Upgrade: h2c`` never reached its
            app, a request pipelined behind it in the same read was never answered, and a body that came in a later
            read was served as a request of its own (a request smuggled inside another's body, answered on a
            connection a proxy may share). Here the request is what HTTP says it is when no upgrade is made: its
            ``Content-Length`` body is its body, and what follows is parsed as the next request (returned: what of
            ``rest`` is left to parse). A chunked body, or a ``CONNECT`` (its tunnel's bytes), is left unread with
            all that follows: the request is answered (a 400 for the body, :data:`UNREAD_BODY`), then the connection
            closes."""
            cycle = self.cycle
            if cycle is None:
                return b""
            headers = cycle.scope["headers"]
            length = next((value for name, value in headers if name == b"content-length"), b"0")
            if cycle.scope["method"] == "CONNECT" or any(name == b"transfer-encoding" for name, _ in headers):
                if cycle.scope["method"] != "CONNECT":
                    cycle.scope[UNREAD_BODY] = True
                self.pipeline_full = True  # nothing after it is read
                self.flow.pause_reading()
                cycle.keep_alive = False
                return b""
            self.owed = int(length)  # (digits only: the parser refused any other Content-Length)
            if self.owed:
                self.owed_cycle = cycle
                cycle.more_body = True  # (the parser had ended the message; its app has not run since)
            return rest

        def _owed_body(self, data: bytes) -> bytes:
            """``data`` less what is owed to the body of the request :meth:`_not_upgraded` read, which goes to it as
            the parser's ``on_body`` would give it."""
            body, rest = data[: self.owed], data[self.owed :]
            self.owed -= len(body)
            cycle = self.owed_cycle
            if cycle is not None and not cycle.response_complete:
                cycle.body += body
                cycle.more_body = self.owed > 0
                if len(cycle.body) > HIGH_WATER_LIMIT:
                    self.flow.pause_reading()
                cycle.message_event.set()
            if not self.owed:
                self.owed_cycle = None
            return rest

        def send_400_response(self, msg: str) -> None:
            if self.pipeline_full:  # the parser stopped at _PipelineFull: nothing unparsable, nothing to answer
                return
            if self.cycle is not None and not self.cycle.response_complete and self.cycle.more_body:
                self._refuse_body(self.cycle)  # its head is in and its message is not: it is its own body
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # unparsable bytes behind requests not yet answered: they are answered first (the 400 went out at
                # once, as the answer of the request in flight, which was never answered), then the 400, and the
                # connection closes; nothing more is read meanwhile
                self.pipeline_full = self.refuse_pending = True
                self.flow.pause_reading()
                return
            _refuse(self.transport)

        def _refuse_body(self, cycle: Any) -> None:
            """``cycle``'s body is not valid chunked coding: it can never be read to its end. The request in
            flight is refused now (a 400 and the connection closed; its app then reads a disconnect), or the
            connection just closed if its answer has begun; one queued behind requests not yet answered is dropped
            from the queue, never run, and refused once they are answered (nothing more is read meanwhile)."""
            queued = next((i for i, (c, _app) in enumerate(self.pipeline) if c is cycle), None)
            if queued is None:
                if cycle.response_started:
                    self.transport.close()
                else:
                    _refuse(self.transport, _malformed_body_error())
                return
            del self.pipeline[queued]
            self.unanswered = [c for c in self.unanswered if c is not cycle]
            self.refusal = _malformed_body_error()
            self.pipeline_full = self.refuse_pending = True
            self.flow.pause_reading()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if (self.refuse_pending and not self.pipeline and self.cycle is not None
                    and all(c.response_complete for c in self.unanswered)):
                self.refuse_pending = False
                if not self.transport.is_closing():
                    _refuse(self.transport, self.refusal)

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


def _refuse(transport: asyncio.Transport, error: APIError | None = None) -> None:
    """What uvicorn's ``send_400_response`` does (its ``msg`` is always "Invalid HTTP request received."),
    in OpenAI's shape: ``error``, by default a request line or headers it could not parse."""
    if error is None:
        error = APIError(400, "The request is not valid HTTP/1.1: the server could not parse its request line or "
                              "headers.", code="invalid_http_request")
    transport.write(error.raw_response(new_request_id("conn")))
    transport.close()


def _framed_twice(headers: Any) -> bool:
    """Whether a request's (lower-case) headers frame its body both by ``Content-Length`` and by
    ``Transfer-Encoding``: a proxy that reads one and a server that reads the other disagree on where the body
    ends, and what one takes for its body the other serves as a request of its own (request smuggling)."""
    names = {bytes(name).lower() for name, _value in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def _framing_error() -> APIError:
    return APIError(400, "The request gives both a Content-Length and a Transfer-Encoding, so where its body ends is "
                         "ambiguous (RFC 9112, 6.3): send one of them.", code="invalid_http_request")


def _malformed_body_error() -> APIError:
    return APIError(400, "The request's chunked body is not valid chunked coding (a chunk size that is no hexadecimal "
                         "number, or a chunk not followed by CRLF): it cannot be read.", code="invalid_http_request")


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
