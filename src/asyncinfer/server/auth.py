"""Who is calling: a request's bearer key, checked against the accepted keys in constant time, and the
headers a decision reads, each given at most once."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from starlette.requests import Request

from asyncinfer.server.errors import APIError, unauthorized


def bearer(request: Request, keys: Sequence[str], refuse: Callable[[bool], APIError] = unauthorized) -> str:
    """The request's bearer key if it is one of ``keys`` (each compared in constant time); otherwise
    ``refuse(got_key)`` is raised (a 401; ``got_key``: whether a key was given at all)."""
    scheme, _, token = (single_header(request, "authorization") or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise refuse(False)
    given = token.encode()
    matches = [hmac.compare_digest(given, key.encode()) for key in keys]
    if not any(matches):
        raise refuse(True)
    return token


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
