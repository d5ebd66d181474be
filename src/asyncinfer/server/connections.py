"""Slow and surplus clients: a header deadline, a body deadline and a cap on open connections.

A client that sends its request a byte at a time holds a connection (a socket, a
parser, a place in the server) for as long as it likes; a few hundred of them starve
everyone else. Three limits of :class:`~asyncinfer.server.ServerSettings` close that:

- ``header_timeout``: :class:`ConnectionGuard`, an asyncio protocol around the ASGI
  server's own HTTP protocol, closes a connection whose request headers are not all in
  within the limit of its opening, or of the end of its previous answer (with a 408 when
  it had begun a request; an idle keep-alive connection is simply closed).
- ``send_timeout``: the guard closes a connection whose send buffer stays full (its client reads
  nothing: the transport's flow control has paused writing) for that long; the app's stream then
  ends as on a disconnect, its requests aborted. A client that asks for a stream and never reads it
  would otherwise hold its connection, and its requests' places in the engine, for ever.
- ``max_connections``: the guard answers a connection over the cap with a 503 and closes it.
- ``MAX_HEADER_BYTES``: the guard answers 431 to a head that passes it unended; :class:`RequestDeadlines` to a
  request whose head, parsed whole, passes it (one that came in a single read, after an earlier request on its
  connection, which the guard leaves to the server: it may be a body the server read as a request's; the guard tells
  the middleware when the bytes it found too long began as a head does, the whitespace its scope drops counted).
- ``body_timeout``: :class:`RequestDeadlines`, an ASGI middleware, answers 408 and closes
  the connection when a request's body is not all in within the limit of its headers
  (unless the answer has begun: a 401 sent before the body was read, say).

Every answer of the app leaves :class:`RequestDeadlines` with an ``X-Request-Id`` (the
routes set their own; any other answer gets ``req-<hex>``), and a refused WebSocket handshake
with an OpenAI-shaped 403 rather than the ASGI server's empty one.

The guard learns that a request's headers are in from the middleware: the ASGI server
starts the app for a request once its headers are parsed, inside the guard's
``data_received``, where a context variable names the guarding connection; the app's
task inherits it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncinfer.server.errors import APIError, elided, new_request_id
from asyncinfer.server.parsers import UNREAD_BODY
from asyncinfer.server.settings import ServerSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_GUARD: ContextVar[ConnectionGuard | None] = ContextVar("asyncinfer_connection_guard", default=None)
LINGER_SECONDS = 0.5  # after a refusal, unread request bytes are drained this long (a close with them unread resets)
GRACE_SECONDS = 0.05  # a deadline is checked twice this far apart: bytes that came in meanwhile count
#: A request's head (request line and headers) may take this many bytes; a longer one is answered 431 and
#: the connection closed (the body has its own limit, ServerSettings.max_body_bytes).
MAX_HEADER_BYTES = 64 * 1024
#: How a head ends: an empty line, its line ends CRLF or the bare LF a parser may take for one (h11 does; RFC 9112, 2.2)
_HEAD_ENDS = (b"\n\r\n", b"\n\n")
#: How a request's head begins (after the empty lines a server ignores before one): a method, a space and a target
#: (a path, ``*``, or a scheme or host and a colon)
_REQUEST_LINE = re.compile(rb"(?:\r?\n)*[!#$%&'*+.^_`|~0-9A-Za-z-]+ (?:/|\*|[A-Za-z0-9][A-Za-z0-9+.-]*:)")
_HEAD_START_BYTES = 64  # bytes of a head kept to tell it from a body


def _head_error() -> APIError:
    return APIError(431, f"The request's headers exceed {MAX_HEADER_BYTES} bytes.", type="invalid_request_error",
                    code="headers_too_large")


def _timeout_error(what: str, seconds: float) -> APIError:
    return APIError(408, f"The request's {what} did not arrive within this server's limit of {seconds:g} seconds.",
                    code="request_timeout")


class ConnectionGuard(asyncio.Protocol):
    """One connection: the ASGI server's HTTP protocol (``inner``) behind a header deadline and the cap.

    ``connections`` is the server's set of open connections (each inner protocol adds
    itself), read for the cap.
    """

    def __init__(self, inner: asyncio.Protocol, connections: set[Any], settings: ServerSettings,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._inner = inner
        self._connections = connections
        self._settings = settings
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # armed while writing is paused (send_timeout)
        self._in_flight = 0  # requests whose headers are in and whose app has not returned
        self._partial = False  # bytes of a request the app has not been started for
        self._refused = False  # answered here; the inner protocol gets no more bytes
        self._inner_open = False  # the inner protocol was told of the connection (so it must hear of its end)
        self._head_bytes: int | None = 0  # bytes of the request head being received (None: its end was seen)
        self._head_tail = b""  # the last bytes seen of it, to find an end split across reads
        self._head_start = b""  # the first bytes of it (up to _HEAD_START_BYTES), to tell a head from a body
        self._after_head = 0  # bytes since the head's end while its request is in flight (body, pipelined requests)
        # The head being counted began when the previous request finished (or the rest of its body): the server may
        # already have parsed it (a request pipelined behind that one, whose app starts a moment later), so the bytes
        # counted may be its body. A head found too long then is refused only if no request has started two turns of
        # the loop later.
        self._head_after_finish = False
        self._confirming = False  # that check is scheduled
        self._starts = 0  # requests started on this connection
        # The rest of a body its request was answered before it was all in (a 401, a 413), which the parser skips:
        # its bytes still to come (None: of a length not declared, until the next request starts), neither a head
        # nor a request begun (they are counted in _after_head, under its bound).
        self._skip: int | None = 0

    # ------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # an asyncio or a uvloop transport
        if len(self._connections) >= self._settings.max_connections:
            self._refuse(APIError(503, f"The server has {self._settings.max_connections} connections open, its "
                                       "limit: retry shortly.", type="server_error", code="too_many_connections",
                                  headers={"retry-after": "1"}))
            return
        self._inner.connection_made(transport)
        self._inner_open = True
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # drained while the refusal lingers
        head = data
        if self._in_flight == 0:
            if self._skip != 0:
                head = self._skipped(data)  # what follows the rest of a body its request was answered before
                if self._after_head > self._after_head_limit:  # (that rest too is bounded)
                    self._refuse(_head_error())
                    return
            if head:
                self._partial = True
        if head and self._head_bytes is not None and len(self._head_start) < _HEAD_START_BYTES:
            self._head_start += head[:_HEAD_START_BYTES - len(self._head_start)]
        if head and self._head_too_long(head):
            if not self._head_after_finish:
                self._refuse(_head_error())
                return
            if not self._confirming:
                self._confirming = True
                self._loop.call_soon(self._confirm_head_too_long, self._starts)
        token = _GUARD.set(self)  # the app's task, started in here once the headers are in, inherits it
        try:
            self._inner.data_received(data)
        finally:
            _GUARD.reset(token)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None  # close
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_send()
        if self._inner_open:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._send_timer is None:
            self._send_timer = self._loop.call_later(self._settings.send_timeout, self._send_expired)
        if self._inner_open:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._disarm_send()
        if self._inner_open:
            self._inner.resume_writing()

    def _disarm_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_expired(self) -> None:
        """The client has read nothing for ``send_timeout``: nothing more can be said to it (its answer has
        begun, and its buffer is full), so the connection is dropped; the app sees a disconnect."""
        self._send_timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.abort()

    # ------------------------------------------------- told by RequestDeadlines
    def request_started(self) -> bool:
        """Whether the request starting is refused for its head: one this count found too long after a request
        finished (see above), which a request started in that time may not be, but is when those bytes began as a
        head does (its length on the wire, the optional whitespace around its header values included, which its
        scope does not keep)."""
        too_long = self._confirming and _REQUEST_LINE.match(self._head_start) is not None
        self._in_flight += 1
        self._starts += 1
        self._partial = False
        self._disarm()
        if self._head_bytes is not None or self._skip != 0:  # the server parsed a head whose end this count had not
            # seen (see above; or counted as the rest of a skipped body): its own bytes are counted from here
            self._head_bytes, self._head_tail, self._after_head, self._skip = None, b"", 0, 0
            self._head_start = b""
        elif self._in_flight > 1:  # the server started it, queued behind a request whose app has not returned yet
            self._after_head = 0  # (whose body, read or skipped, was all before this one's head): counted from here
        self._head_after_finish = False
        return too_long

    def request_finished(self, body_pending: bool = False, body_length: int | None = None) -> None:
        """``body_pending``: its app answered before its body was all read (a 401, a 413): what the client still
        sends is that body, which the parser skips, not the next request's head (nor a request begun, which the
        header deadline would answer 408), up to ``body_length``, its declared length (None: not declared, a
        chunked body: until the next request starts)."""
        self._in_flight -= 1
        if self._in_flight == 0:
            # What follows may not be where this count puts it: the server may have parsed the next request's head
            # already (its body is what comes now), or this request's body may have begun before its app started
            # (bytes this count gave the one before): a head found too long from here waits for the next turns.
            self._head_after_finish = True
            if not body_pending and self._head_bytes is None and body_length is not None:
                # bytes past its body came before it ended: the next request begun (pipelined, its head not all in;
                # not the CRLF some clients send after a body, which a server ignores before a request line)
                self._partial = self._after_head > body_length + 2
            if body_pending and self._head_bytes is None:  # counted on as bytes after its head, under their bound
                self._skip = None if body_length is None else max(0, body_length - self._after_head)
                if self._skip == 0:  # (all in meanwhile; and past it, as above, the next request begun)
                    self._partial = self._after_head > (body_length or 0) + 2
                    self._head_bytes, self._head_tail, self._after_head, self._head_start = 0, b"", 0, b""
            else:  # the next head is counted afresh
                self._head_bytes, self._head_tail, self._after_head, self._head_start = 0, b"", 0, b""
            self._arm()

    def _confirm_head_too_long(self, starts: int, turns: int = 2) -> None:
        """Refuse the head found too long unless a request has started since: ``turns`` turns of the loop later
        (the server creates a request's task as it parses its head, in the same ``data_received`` that found the
        head too long: the task's first step comes one turn after this check was scheduled)."""
        if turns > 1:
            self._loop.call_soon(self._confirm_head_too_long, starts, turns - 1)
            return
        self._confirming = False
        if self._starts == starts and not self._refused:  # no request started: it was a head, and too long
            self._refuse(_head_error())

    # ---------------------------------------------------------------- inside
    @property
    def _after_head_limit(self) -> int:
        return 2 * self._settings.max_body_bytes + MAX_HEADER_BYTES

    def _skipped(self, data: bytes) -> bytes:
        """``data`` less what is the rest of a skipped body (counted in ``_after_head``); past its end, the next
        head is counted afresh."""
        if self._skip == 0:
            return data
        if self._skip is None:  # a length not declared: all of it, until the next request starts
            self._after_head += len(data)
            return b""
        body, data = data[:self._skip], data[self._skip:]
        self._skip -= len(body)
        self._after_head += len(body)
        if self._skip == 0:
            self._head_bytes, self._head_tail, self._after_head, self._head_start = 0, b"", 0, b""
        return data

    def _head_too_long(self, data: bytes) -> bool:
        """Count ``data`` into the request head until its end (an empty line) is seen; whether the head
        has passed :data:`MAX_HEADER_BYTES` without ending. Past its end, while its request is in flight, the
        bytes that follow (its body, then any request pipelined behind it, whose head no parser here bounds:
        httptools takes headers of any size) may be at most twice ``max_body_bytes`` plus
        :data:`MAX_HEADER_BYTES` (a body over ``max_body_bytes`` is the app's 413 long before)."""
        if self._head_bytes is None:
            self._after_head += len(data)
            return self._after_head > self._after_head_limit
        seen = self._head_tail + data
        end = _head_end(seen)
        if end >= 0:
            total = (self._head_bytes or 0) - len(self._head_tail) + end
            self._head_bytes = None  # the rest is body (or the next pipelined request), counted in _after_head
            self._after_head = len(seen) - end
            return total > MAX_HEADER_BYTES
        self._head_bytes = (self._head_bytes or 0) + len(data)
        self._head_tail = seen[-3:]
        return self._head_bytes > MAX_HEADER_BYTES

    def _arm(self) -> None:
        self._disarm()
        if self._transport is not None and not self._transport.is_closing():
            self._timer = self._loop.call_later(self._settings.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, final: bool = False) -> None:
        self._timer = None
        if self._in_flight or self._transport is None or self._transport.is_closing():
            return
        if not final:  # a loop that woke late runs its timers before reading: read what is there first
            self._timer = self._loop.call_later(GRACE_SECONDS, self._expire, True)
            return
        if self._partial:
            self._refuse(_timeout_error("headers", self._settings.header_timeout))
        else:  # an idle keep-alive connection: nothing to answer
            self._transport.close()

    def _refuse(self, error: APIError) -> None:
        """Answer ``error`` and close; what the client still sends is read and dropped a moment first,
        so that the close does not reset the connection before the client reads the answer."""
        transport = self._transport
        assert transport is not None
        self._refused = True
        self._disarm()
        transport.write(error.raw_response(new_request_id("conn")))
        if transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(LINGER_SECONDS, transport.close)
        else:
            transport.close()


def _head_end(data: bytes) -> int:
    """Where the first head end in ``data`` ends (an empty line, CRLF or bare LF: a head sent with bare LFs, which
    h11 serves, was counted on into its body and answered 431 when that passed MAX_HEADER_BYTES); -1: none."""
    ends = [at + len(end) for end in _HEAD_ENDS if (at := data.find(end)) >= 0]
    return min(ends, default=-1)


class GuardedHTTP:
    """What uvicorn's ``Config(http=...)`` takes: makes a :class:`ConnectionGuard` around ``protocol`` for
    each connection. ``protocol``: ``"auto"``, ``"h11"`` or ``"httptools"``, uvicorn's HTTP/1.1 protocols
    as :mod:`asyncinfer.server.parsers` has them (a request they cannot parse gets an OpenAI 400), or a
    protocol class of your own, used as it is."""

    def __init__(self, settings: ServerSettings, protocol: str | type[asyncio.Protocol] = "auto") -> None:
        if isinstance(protocol, str):
            from asyncinfer.server.parsers import http_protocol

            protocol = http_protocol(protocol)
        self._settings = settings
        self._protocol = protocol

    def __call__(self, *, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> ConnectionGuard:
        inner = self._protocol(config=config, server_state=server_state, app_state=app_state,  # type: ignore[call-arg]
                               _loop=_loop)
        loop = _loop or asyncio.get_running_loop()
        return ConnectionGuard(inner, server_state.connections, self._settings, loop)


@dataclass
class _Progress:
    body_done: bool
    started: bool = False
    asked: bool = False  # the app asked for the body (so a `100 Continue` went out, if the client expected one)


class RequestDeadlines:
    """ASGI middleware: the body deadline, an ``X-Request-Id`` on every answer, and the guard told
    when a request is in flight (so that its header deadline waits for the next one)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.body_timeout = settings.body_timeout
        # ServerSettings.instance_id on every answer, the app's own (a 404 or 405 of no route) and this middleware's
        # (a 408) too: the router alone set it, on its routes' answers
        self.headers: tuple[tuple[bytes, bytes], ...] = (
            () if settings.instance_id is None else ((b"x-asyncinfer-instance", settings.instance_id.encode()),))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # in flight for the guard while it lasts: the header deadline is for heads (it
            # wrote its 408 into an accepted WebSocket's frames, header_timeout after the handshake)
            guard = _GUARD.get()
            if guard is not None:
                guard.request_started()
            try:
                refusing = "websocket.http.response" in scope.get("extensions", {})
                await self.app(scope, receive, _websocket_refusal(scope, send) if refusing else send)
            finally:
                if guard is not None:
                    guard.request_finished()
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        guard = _GUARD.get()
        head_too_long = guard is not None and guard.request_started()
        progress = _Progress(body_done=not _has_body(scope))
        try:
            if head_too_long or _head_size(scope) > MAX_HEADER_BYTES:  # a head the guard's count let through: after a
                # request on its connection, a head found too long is refused only if no request starts (it may be a
                # body the server read as a request's, whose head it had parsed); a too-long head that arrives whole
                # starts one (the guard knows it by its start; its scope's size, without the whitespace, is the floor)
                progress.body_done = True  # (unread: the connection closes after this answer)
                await _send_error(send, _head_error(), self.headers)
                return
            if scope.get(UNREAD_BODY):  # the parser left its body unread (and closes the connection after it)
                progress.body_done = True
                await _send_error(send, _unread_body(scope), self.headers)
                return
            await self._serve(scope, receive, send, progress)
        finally:
            if guard is not None:
                guard.request_finished(not progress.body_done, _declared_length(scope))

    async def _serve(self, scope: Scope, receive: Receive, send: Send, progress: _Progress) -> None:

        async def receive_() -> Message:
            progress.asked = True
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                progress.body_done = True  # the last piece, or the client is gone
            return message

        async def send_(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress.started = True
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", new_request_id().encode()))
                for name, value in self.headers:
                    if not any(have.lower() == name for have, _ in headers):
                        headers.append((name, value))
                if (not progress.asked and not progress.body_done and _expects_continue(scope)
                        and not any(name.lower() == b"connection" for name, _ in headers)):
                    # answered before its body was asked for: no `100 Continue` went out, so the client may send no
                    # body (RFC 9110, 10.1.1), and the connection, waiting for it, would read its next request as
                    # that body: it closes after this answer, and says so
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        if progress.body_done:
            await self.app(scope, receive_, send_)
            return
        task = asyncio.ensure_future(self.app(scope, receive_, send_))
        try:
            await asyncio.wait((task,), timeout=self.body_timeout)
            if not task.done() and not progress.body_done and not progress.started:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if not progress.started:
                    await _send_error(send, _timeout_error("body", self.body_timeout), self.headers)
                return
            await task
        finally:
            task.cancel()


async def _send_error(send: Send, error: APIError, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """``error`` as a request's whole answer, after which the connection closes; ``extra``: more headers."""
    body = msgspec.json.encode(error.body())
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"x-request-id", new_request_id().encode()), (b"connection", b"close"), *extra]})
    await send({"type": "http.response.body", "body": body})


def _unread_body(scope: Scope) -> APIError:
    upgrade = next((value for name, value in scope.get("headers", ()) if name == b"upgrade"), b"")
    shown = elided(upgrade.decode("latin-1"))
    return APIError(400, f"The request asks to upgrade the connection (Upgrade: {shown}), which this server does not "
                         "do, and its body is chunked, which it then does not read: send it without `Upgrade`, or "
                         "with a `Content-Length`.", code="unsupported_upgrade")


def _websocket_refusal(scope: Scope, send: Send) -> Send:
    """``send`` for a WebSocket handshake, where a close before any accept (the app refuses it: no route
    takes it, say) becomes an OpenAI-shaped 403 with an ``X-Request-Id`` instead of the ASGI server's empty
    one (through the ASGI "WebSocket denial response" extension the scope names)."""
    accepted = False

    async def send_(message: Message) -> None:
        nonlocal accepted
        if message["type"] == "websocket.close" and not accepted:
            error = APIError(403, f"The WebSocket handshake on {elided(scope.get('path', ''))} was refused: no route "
                                  "of this server accepted it.", code="websocket_refused")
            body = msgspec.json.encode(error.body())
            await send({"type": "websocket.http.response.start", "status": error.status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"x-request-id", new_request_id().encode())]})
            await send({"type": "websocket.http.response.body", "body": body})
            return
        accepted = accepted or message["type"] in ("websocket.accept", "websocket.http.response.start")
        await send(message)

    return send_


def _head_size(scope: Scope) -> int:
    """The bytes of the request's head as its scope has them (its request line and headers, without the optional
    whitespace a client may add: at most what came on the wire)."""
    query = scope.get("query_string", b"")
    line = len(scope.get("method", "")) + len(scope.get("raw_path") or b"") + (len(query) + 1 if query else 0) + 12
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ())) + 2


def _declared_length(scope: Scope) -> int | None:
    """The body's length as its ``Content-Length`` declares it (None: not declared, or a chunked body)."""
    length = None
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            digits = value.strip().lstrip(b"0") or b"0"  # (the parser reads leading zeros past int()'s digits)
            if not digits.isdigit() or len(digits) > 30:
                return None
            length = int(digits)
    return length


def _expects_continue(scope: Scope) -> bool:
    return any(name == b"expect" and value.strip().lower() == b"100-continue" for name, value in scope.get("headers", ()))


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False
