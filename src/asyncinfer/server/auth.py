"""Who is calling: a request's bearer key, checked against the accepted keys in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from starlette.requests import Request

from asyncinfer.server.errors import APIError, unauthorized


def bearer(request: Request, keys: Sequence[str], refuse: Callable[[bool], APIError] = unauthorized) -> str:
    """The request's bearer key if it is one of ``keys`` (each compared in constant time); otherwise
    ``refuse(got_key)`` is raised (a 401; ``got_key``: whether a key was given at all)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise refuse(False)
    given = token.encode()
    matches = [hmac.compare_digest(given, key.encode()) for key in keys]
    if not any(matches):
        raise refuse(True)
    return token


def is_v1(path: str) -> bool:
    """Whether ``path`` is under ``/v1``, where every answer, even "no such URL", needs an API key."""
    return path == "/v1" or path.startswith("/v1/")
