"""OpenAI-style error bodies, and which engine error becomes which HTTP status.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}``, the body
OpenAI's clients parse. Engine faults (anything not raised on purpose for the
caller) are logged with the request id and answered with a 500 that carries the
id, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from starlette.responses import Response

import asyncinfer.errors as engine_errors
from asyncinfer.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidParameterError,
    RequestAbortedError,
)

log = logging.getLogger("asyncinfer.server")

# The engine's hardening work adds this one (a bounded waiting queue); map it when it exists.
_OVERLOADED: type[BaseException] | None = getattr(engine_errors, "EngineOverloadedError", None)


class APIError(Exception):
    """An error answered as an HTTP status with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> Response:
        headers = dict(self.headers)
        if request_id is not None:
            headers["x-request-id"] = request_id
        return Response(msgspec.json.encode(self.body()), self.status, headers, media_type="application/json")


def not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unauthorized(got_key: bool) -> APIError:
    message = "Incorrect API key provided." if got_key else (
        "You didn't provide an API key. You need to provide your API key in an Authorization header "
        "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
    )
    return APIError(401, message, code="invalid_api_key" if got_key else None)


def from_exception(exc: BaseException, request_id: str, rename: Callable[[str], str] = lambda p: p) -> APIError:
    """The API error for ``exc``; ``rename`` maps an engine parameter name to the body's field."""
    if isinstance(exc, APIError):
        return exc
    if _OVERLOADED is not None and isinstance(exc, _OVERLOADED):
        retry = getattr(exc, "retry_after", None) or 1
        return APIError(503, f"The server is overloaded: {exc}", type="server_error", code="overloaded",
                        headers={"retry-after": str(max(1, round(retry)))})
    if _is_template_error(exc):  # e.g. a template's raise_exception("roles must alternate")
        return APIError(400, f"The model's chat template refused these messages: {exc}", param=rename("prompt"))
    if isinstance(exc, InvalidParameterError):
        if exc.parameter == "model":
            return APIError(404, str(exc), param="model", code="model_not_found")
        code = "context_length_exceeded" if "max_model_len" in exc.allowed else None
        return APIError(400, str(exc), param=rename(exc.parameter), code=code)
    if isinstance(exc, EngineClosedError) and not isinstance(exc, EngineDeadError):
        # Stopping, or a drain-mode swap with no version serving yet: come back shortly.
        return APIError(503, f"The engine is not serving right now: {exc}", type="server_error",
                        code="unavailable", headers={"retry-after": "1"})
    if isinstance(exc, RequestAbortedError) and exc.__cause__ is None:
        return APIError(503, f"The request was aborted: {exc}", type="server_error", code="aborted",
                        headers={"retry-after": "1"})
    log.error("request %s failed", request_id, exc_info=exc)
    return APIError(500, f"The server had an error while processing your request (request id {request_id}).",
                    type="server_error", code="internal_error")


def _is_template_error(exc: BaseException) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # no jinja2, no chat templates
        return False
    return isinstance(exc, TemplateError)
