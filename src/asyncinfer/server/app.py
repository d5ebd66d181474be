"""``create_app``: a whole OpenAI-compatible server around one engine, and ``run_server`` for uvicorn.

One process, one engine, one copy of each model, many concurrent requests: the
app's lifespan loads (or takes) the engine, starts it on the serving loop, adds
any further models, and closes it at shutdown. :func:`guard_app` gives an app
OpenAI's error shape on every route, an ``X-Request-Id`` on every answer and the
body deadline; :func:`server_config` (and :func:`run_server`) puts uvicorn's
connections behind the header deadline and the connection cap.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from asyncinfer.engine import AsyncEngine, EngineState
from asyncinfer.errors import AsyncInferError, EngineClosedError, InvalidParameterError
from asyncinfer.server.auth import bearer, is_v1
from asyncinfer.server.connections import MAX_HEADER_BYTES, GuardedHTTP, RequestDeadlines
from asyncinfer.server.errors import (
    APIError,
    from_exception,
    http_error,
    internal_error,
    new_request_id,
    validation_error,
)
from asyncinfer.server.router import openai_router
from asyncinfer.server.settings import ModelSpec, ServerSettings, model_specs

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup as _Group
else:  # anyio's dependency on Python 3.10
    from exceptiongroup import BaseExceptionGroup as _Group

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import uvicorn

_DOC_PAGES = ("docs_url", "redoc_url", "openapi_url")


class _EngineSlot:
    """The engine the lifespan set up; asking before it is there is a 503 (still starting)."""

    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None

    def __call__(self) -> AsyncEngine:
        if self.engine is None:
            raise EngineClosedError("the server is starting or stopping")
        return self.engine


def create_app(
    engine_or_models: AsyncEngine | ModelSpec | Sequence[ModelSpec] | None = None,
    settings: ServerSettings | None = None,
    **fastapi_options: Any,
) -> FastAPI:
    """A FastAPI app serving the OpenAI routes of :func:`openai_router` over one engine.

    ``engine_or_models``: an :class:`AsyncEngine` not started yet (the app starts it on
    its loop and closes it at shutdown; a running one is used and left running), or
    the models to load at start-up: a :class:`ModelSpec` or a list of them (the first
    builds the engine, the others are added with ``add_model``). ``None`` serves the
    default model. ``fastapi_options`` go to ``FastAPI(...)``.

    FastAPI's pages (``/docs``, ``/redoc``, ``/openapi.json``) are off: they would answer
    without a key. ``docs_url=...`` (and the others) turns one on, on a server without API
    keys only (``InvalidParameterError`` otherwise). The app is :func:`guard_app`'s.
    """
    settings = settings or ServerSettings()
    pages = {name: fastapi_options.pop(name, None) for name in _DOC_PAGES}
    on = {name: url for name, url in pages.items() if url is not None}
    if on and settings.accepted_keys:
        name, url = next(iter(on.items()))
        raise InvalidParameterError(name, url, "None on a server with API keys (the page would answer without one)")
    slot = _EngineSlot()
    specs = () if isinstance(engine_or_models, AsyncEngine) else model_specs(
        ModelSpec(None, ModelSpec.served_name(None)) if engine_or_models is None else engine_or_models)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if isinstance(engine_or_models, AsyncEngine):
            engine, owned = engine_or_models, engine_or_models.state is EngineState.CREATED
            if engine.state in (EngineState.CLOSED, EngineState.DEAD):  # it served 503 to every request
                raise EngineClosedError(
                    f"the engine given to create_app is {engine.state.value} (an app closes the engine it started "
                    "at shutdown, so a second start-up of the same app, a second 'with TestClient(app)' say, has none "
                    "to serve): give create_app ModelSpecs, loaded at each start-up, or build the app with a new "
                    "engine")
        else:
            first = specs[0]
            engine = await anyio.to_thread.run_sync(
                lambda: AsyncEngine.from_pretrained(first.model, name=first.name, **first.options))
            owned = True
        if owned:
            await engine.start()
        try:
            for spec in specs[1:]:
                await engine.add_model(spec.name, spec.model, **spec.options)
            _say_what_cannot_chat(engine)
            slot.engine = app.state.engine = engine
            yield
        finally:
            slot.engine = None
            if owned:
                await engine.aclose(abort=True)  # uvicorn has already let the requests in flight finish

    app = FastAPI(**{"title": "asyncinfer", "lifespan": lifespan, **pages, **fastapi_options})
    app.include_router(openai_router(slot, settings))
    guard_app(app, settings)
    return app


def _say_what_cannot_chat(engine: AsyncEngine) -> None:
    """A warning at start-up for each generator that chat completions will refuse (no chat template, or no
    tokenizer): the banner of ``asyncinfer serve`` is printed before the models load, and their first chat
    request would be the first to learn it."""
    from asyncinfer.models.tokenizer import chat_template_of

    for info in engine.model_info():
        if info.kind != "generate":
            continue
        tokenizer = engine.get_tokenizer(info.name)
        if tokenizer is None:
            log.warning("model %r has no tokenizer: /v1/chat/completions and text prompts are refused (400); "
                        "/v1/completions takes token ids", info.name)
        elif chat_template_of(tokenizer) is None:
            log.warning("model %r has no chat template: /v1/chat/completions is refused (400); /v1/completions "
                        "takes its prompts as text", info.name)


def guard_app(app: FastAPI, settings: ServerSettings | None = None) -> FastAPI:
    """Prepare an app that serves :func:`openai_router` (``create_app`` does it for its own):

    - every error, on every route, in OpenAI's shape: a URL no route serves is a 404
      ``unknown_url``, a method the route does not take a 405 ``method_not_allowed`` (with
      ``Allow``), a fault outside the routes a 500 ``internal_error`` with the request id;
    - on a server with API keys (``settings.accepted_keys``), those 404s and 405s under ``/v1``
      are a 401 first for a request without an accepted key: no route discovery without one;
    - an ``X-Request-Id`` on every answer, and a refused WebSocket handshake answered as an
      OpenAI 403 ``websocket_refused`` rather than uvicorn's empty one;
    - an :class:`APIError` a route of the app's own raises (the 401 of
      :func:`~asyncinfer.server.require_api_key`, or one of its own) answered in that shape, and so is an
      :class:`~asyncinfer.AsyncInferError` it lets through from the engine (a prompt too long: 400; overloaded:
      503), without uvicorn's "Exception in ASGI application" traceback for a client's bad request;
    - ``settings.body_timeout``: a body not all in that long after its headers is a 408 and
      the connection closes;
    - no redirect for a trailing slash (``app.router.redirect_slashes`` off): Starlette's 307 to the
      URL without it answered before any key was checked, with a ``Location`` built from the
      ``Host`` header; ``/v1/chat/completions/`` is an unknown URL like any other.

    Call it before the app serves (it adds middlewares). Returns ``app``.
    """
    settings = settings or ServerSettings()
    app.router.redirect_slashes = False
    app.add_exception_handler(HTTPException, _keyed_http_errors(settings.accepted_keys))
    app.add_exception_handler(APIError, _api_error)  # require_api_key's refusal, in a deployment's own routes
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
    # An engine error in a deployment's own route (a prompt too long, an overloaded engine), answered as the router's
    # routes answer it: the handler of `Exception` above answers it too, but Starlette runs that one in its outermost
    # middleware and raises the exception again, so uvicorn logged each such 400 or 503 as "Exception in ASGI
    # application" with its traceback (and a handler of AsyncInferError's would wrap one raised mid-stream in
    # Starlette's "Caught handled exception, but response already started")
    app.add_middleware(_EngineErrorAnswers)
    app.add_middleware(RequestDeadlines, settings=settings)
    return app


class _EngineErrorAnswers:
    """ASGI middleware: an :class:`AsyncInferError` a route of the app's own lets through (or an exception group of
    nothing else, from the route's task group: its most severe), before its answer started, answered in OpenAI's shape as
    the router's routes answer it (a 400 naming the parameter, a 503 with ``Retry-After``, ...), logged only where it
    is a fault of the server (a 500: a dead engine, a failed request); one raised once the answer has started goes
    on up, as any fault does."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as exc:
            # told apart before any answer is made: making one logs a 500-class member, and a fault raised on (a
            # group holding a bug, or an answer already begun) was logged again as itself, under another id
            if started or not _engine_errors_only(exc):
                raise
            request_id = new_request_id()
            await _engine_error(exc, request_id).response(request_id)(scope, receive, send)


def _engine_errors_only(exc: BaseException) -> bool:
    """Whether ``exc`` is an :class:`AsyncInferError`, or an exception group (a route's task group) of nothing else."""
    if isinstance(exc, AsyncInferError):
        return True
    return isinstance(exc, _Group) and bool(exc.exceptions) and all(map(_engine_errors_only, exc.exceptions))


def _engine_error(exc: BaseException, request_id: str) -> APIError:
    """The answer to ``exc`` (:func:`_engine_errors_only`): an :class:`AsyncInferError`'s, or for an exception group,
    its most severe member's (the highest status; the first of equals), whatever order the group's tasks failed in."""
    if isinstance(exc, _Group):
        return max((_engine_error(e, request_id) for e in exc.exceptions), key=lambda answer: answer.status)
    return from_exception(exc, request_id)


def _api_error(request: Request, exc: Exception) -> Response:
    """An :class:`APIError` raised outside the router's routes (by :func:`~asyncinfer.server.require_api_key`
    in a route of the app's own), answered as the routes answer theirs."""
    assert isinstance(exc, APIError)
    return exc.response(new_request_id())


def _keyed_http_errors(keys: tuple[str, ...]) -> Callable[[Request, Exception], Response]:
    """:func:`http_error`, behind the API key under ``/v1`` when there are keys."""

    def handler(request: Request, exc: Exception) -> Response:
        if keys and is_v1(request.url.path):
            try:
                bearer(request, keys)
            except APIError as refused:
                return refused.response(new_request_id())
        return http_error(request, exc)

    return handler


def server_config(app: Any, settings: ServerSettings | None = None, host: str = "127.0.0.1", port: int = 8000,
                  log_level: str = "info", http: str = "auto", **uvicorn_options: Any) -> uvicorn.Config:
    """uvicorn's ``Config`` for ``app``, its connections behind ``settings.header_timeout`` and
    ``settings.max_connections`` (see :mod:`asyncinfer.server.connections`). ``http``: uvicorn's HTTP/1.1
    parser, ``"auto"`` (httptools where installed, else h11), ``"h11"`` or ``"httptools"``; a request
    it cannot parse is answered with an OpenAI-shaped 400 either way."""
    import uvicorn

    settings = settings or ServerSettings()
    guarded = GuardedHTTP(settings, http)
    # h11 buffers at most 16 KiB of an unfinished head by default, and refuses more as unparseable: a head the
    # guard's limit (MAX_HEADER_BYTES) allows, and httptools serves, read in several pieces was a 400
    uvicorn_options.setdefault("h11_max_incomplete_event_size", MAX_HEADER_BYTES)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=guarded,  # type: ignore[arg-type]
                          **uvicorn_options)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               settings: ServerSettings | None = None, sock: socket.socket | None = None) -> bool:
    """Serve ``app`` with uvicorn until interrupted, under ``settings``' connection limits
    (pass the settings the app was made with; the defaults otherwise). Returns whether it ended on
    Ctrl-C (SIGINT; ``asyncinfer serve`` then exits 130). ``sock``: a socket already bound and
    listening on ``host:port`` (``asyncinfer.commands.serve.listening_socket``), served instead of
    one uvicorn binds after the app's start-up (the model's load)."""
    startup = _StartupErrors(app)
    server = _server_class()(server_config(startup, settings, host, port, log_level))
    interrupted = False
    try:
        server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:  # uvicorn has shut down gracefully and re-raised the signal, as uvicorn.run swallows it
        interrupted = True
    except SystemExit:  # uvicorn's own exit when the start-up failed
        if startup.error is None:
            raise
    interrupted = interrupted or server.interrupted  # type: ignore[attr-defined]
    if not server.started:
        if startup.error is not None and not interrupted:
            raise startup.error  # the typed error, once: asyncinfer serve says it in one line (status 2)
        raise SystemExit(130 if interrupted else 3)  # 3: uvicorn.run's status when the server could not start
    return interrupted


class _StartupErrors:
    """The app, whose start-up failing with a typed error (an :class:`AsyncInferError`: a model that does not
    load, a bad option) is kept in ``error`` for :func:`run_server` to raise, rather than logged by uvicorn as
    the lifespan's traceback; any other failure keeps its traceback (a fault, not the user's input)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.error: AsyncInferError | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        held: list[Any] = []

        async def hold_failure(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed":
                held.append(message)  # sent once the error is known: without the traceback when it is typed
            else:
                await send(message)

        try:
            await self.app(scope, receive, hold_failure)
        except AsyncInferError as exc:
            if held:
                self.error = exc
                await send({**held[0], "message": ""})
            raise
        except BaseException:
            for message in held:
                await send(message)
            raise


#: Seconds a forced quit (a second Ctrl-C) gives the engine's close and the aborted requests' answers.
FORCED_QUIT_GRACE = 5.0


def _server_class() -> type[uvicorn.Server]:
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose forced quit (a second Ctrl-C while requests are in flight) ends them
        cleanly: uvicorn skips the app's shutdown and leaves the requests running, so the loop's close
        cancelled them and the lifespan, which printed two tracebacks and never closed the engine. Here the
        lifespan's shutdown runs (the engine closes, aborting what is in flight, so each answer ends), and
        what still runs after ``FORCED_QUIT_GRACE`` seconds is cancelled before the loop closes."""

        interrupted = False  # a SIGINT came: Ctrl-C, or kill -INT

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises the signal once shut down, for Python's KeyboardInterrupt, which never comes where
            # SIGINT was ignored when the process started (a job started with & where a shell has no job control,
            # nohup): `kill -INT` then ended it with status 0, not 130
            if sig == signal.SIGINT:
                self.interrupted = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            if not self.force_exit:
                return
            try:
                await asyncio.wait_for(self.lifespan.shutdown(), FORCED_QUIT_GRACE)
            except asyncio.TimeoutError:
                pass
            tasks = set(self.server_state.tasks)
            if tasks:
                _done, pending = await asyncio.wait(tasks, timeout=FORCED_QUIT_GRACE)
                for task in pending:
                    task.cancel()

    return Server
