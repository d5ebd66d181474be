"""Who is calling: a request's bearer key, checked against the accepted keys in constant time, and the
headers a decision reads, each given at most once (checked after the key, and only where it is read)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request

from asyncinfer.server.errors import APIError, unauthorized
from asyncinfer.server.settings import ServerSettings


def bearer(request: Request, keys: Sequence[str], refuse: Callable[[bool], APIError] = unauthorized) -> str:
    """The request's bearer key if it is one of ``keys`` (each compared in constant time); otherwise
    ``refuse(got_key)`` is raised (a 401; ``got_key``: whether a key was given at all).

    Every copy of ``Authorization`` is checked, and a request that gives it more than once is the 400
    ``duplicate_header`` (:func:`single_header`) only once one copy holds an accepted key: a caller
    without one gets the 401 and learns nothing more (not which headers a decision reads)."""
    values = request.headers.getlist("authorization")
    accepted: str | None = None
    got_key = False
    for value in values:
        scheme, _, token = value.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            continue
        got_key = True
        given = token.encode()
        matches = [hmac.compare_digest(given, key.encode()) for key in keys]
        if any(matches) and accepted is None:
            accepted = token
    if accepted is None:
        raise refuse(got_key)
    single_header(request, "authorization")
    return accepted


def single_header(request: Request, name: str) -> str | None:
    """The value of header ``name`` (``None`` when absent); a 400 ``duplicate_header`` naming it when the
    request gives it more than once: whichever copy a decision read, a client could pre-empt the copy a
    proxy in front of the server appends (its own ``Authorization``, tenant or priority)."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise APIError(400, f"The `{name}` header is given {len(values)} times; it must be given at most once.",
                       code="duplicate_header")
    return values[0] if values else None


def is_v1(path: str) -> bool:
    """Whether ``path`` is under ``/v1``, where every answer, even "no such URL", needs an API key."""
    return path == "/v1" or path.startswith("/v1/")


def require_api_key(settings: ServerSettings) -> Callable[[Request], Awaitable[str | None]]:
    """A FastAPI dependency that asks a deployment's own routes for an API key, as the routes of
    :func:`~asyncinfer.server.openai_router` ask for it under the same ``settings``:

        @app.get("/haiku", dependencies=[Depends(require_api_key(settings))])

    It returns the caller's key (``None`` on a server without keys, where everyone gets in; declare
    ``key: str | None = Depends(require_api_key(settings))`` to read it). A missing or wrong key is the
    routes' own 401, OpenAI's error body with an ``X-Request-Id``, answered by the handler
    :func:`~asyncinfer.server.guard_app` installs (in an app without it, the refusal is a plain 500, never
    the route)."""
    keys = settings.accepted_keys

    async def api_key(request: Request) -> str | None:
        return bearer(request, keys) if keys else None

    return api_key
