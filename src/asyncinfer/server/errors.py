"""OpenAI-style error bodies, and which engine error becomes which HTTP status.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}``, the body
OpenAI's clients parse, with an ``X-Request-Id``. Engine faults (anything not raised
on purpose for the caller) are logged with the request id and answered with a 500
that carries the id, never a traceback. The app-level handlers here give the same
shape to what no route answers: unknown URLs (404), wrong methods (405), and a fault
outside the routes (500).
"""

from __future__ import annotations

import http
import logging
import math
import sys
import uuid
from collections.abc import Callable, Sequence

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

import asyncinfer.errors as engine_errors
from asyncinfer.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidParameterError,
    MaxTokensOverContextError,
    ModelChangedError,
    PromptTooLongError,
    RequestAbortedError,
    RequestFailedError,
    _short_repr,
    range_in_words,
)
from asyncinfer.prompts import NO_CHAT_TEMPLATE, NO_TOKENIZER

log = logging.getLogger("asyncinfer.server")

#: A chat completion for a model that cannot render chat messages: why, and where its prompt goes instead.
_NO_CHAT = {
    NO_CHAT_TEMPLATE: "This model has no chat template, so chat messages cannot be rendered for it: send its "
                      "prompt to /v1/completions as text.",
    NO_TOKENIZER: "This model was loaded without a tokenizer, so chat messages cannot be rendered for it: send "
                  "its prompt to /v1/completions as token ids.",
}

#: A text prompt for a model without a tokenizer (on /v1/completions: the chat's message pointed to that very route).
_NO_TEXT = ("This model was loaded without a tokenizer, so a text prompt cannot be encoded for it: send `prompt` as "
            "token ids (a list of integers, or a list of such lists).")


#: The header that tells OpenAI's clients not to retry an answer (they retry every 5xx, and 408, 409 and 429, unless
#: it says ``false``): a 501 is this server's lack, which no retry mends.
NO_RETRY = {"x-should-retry": "false"}


def new_request_id(prefix: str = "req") -> str:
    """A fresh id for one answer: ``<prefix>-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


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

    def raw_response(self, request_id: str) -> bytes:
        """The error as a whole HTTP/1.1 response that closes the connection, written straight to a socket
        (by the connection guard and the HTTP parsers, before or without any app)."""
        body = msgspec.json.encode(self.body())
        lines = [f"HTTP/1.1 {self.status} {http.HTTPStatus(self.status).phrase}", "content-type: application/json",
                 f"content-length: {len(body)}", f"x-request-id: {request_id}", "connection: close",
                 *(f"{name}: {value}" for name, value in self.headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


MAX_SHOWN_NAME = 256  # characters of a client's model name echoed in an error


#: How much of a client's value an error echoes: characters of a string, items of a list or object, levels of nesting.
_SHOWN_CHARS, _SHOWN_ITEMS, _SHOWN_LEVELS = 240, 32, 4


def shown(value: object) -> str:
    """A client's value as an error message echoes it: in JSON, as the client wrote it (``"yes"``, ``null``,
    ``true``, never Python's ``'yes'``, ``None``, ``True``), elided past a few hundred characters (as
    ``InvalidParameterError`` elides values), so a megabyte sent in a field is never answered back whole."""
    return _json_shown(value, 0)


def _json_shown(value: object, level: int) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str):
        cut = value[:_SHOWN_CHARS]
        text = msgspec.json.encode(cut).decode()
        return text if cut == value else f"{text[:-1]}...\" ({len(value)} characters)"
    if isinstance(value, float):
        if math.isfinite(value):
            return repr(value)
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"  # as Python's json writes them
    if isinstance(value, (list, tuple, dict)):
        opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
        if level >= _SHOWN_LEVELS:
            return f"{opening}...{closing}" if value else f"{opening}{closing}"
        items = list(value.items())[:_SHOWN_ITEMS] if isinstance(value, dict) else list(value[:_SHOWN_ITEMS])
        shown_items = [f"{_json_shown(str(k), level + 1)}: {_json_shown(v, level + 1)}" for k, v in items] \
            if isinstance(value, dict) else [_json_shown(v, level + 1) for v in items]
        more = ", ..." if len(value) > _SHOWN_ITEMS else ""
        return f"{opening}{', '.join(shown_items)}{more}{closing}"
    if isinstance(value, int):  # as JSON writes it, cut as a text is (4,000 digits were echoed whole)
        try:
            text = str(value)
        except ValueError:  # past the interpreter's limit on an int's digits
            return f"<an integer of more than {sys.get_int_max_str_digits()} digits>"
        return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} digits)"
    return _short_repr(value)  # what a route built itself


def json_terms(allowed: str) -> str:
    """An engine error's allowed range (``"None or an int in [0, 2**63 - 1]"``) as an HTTP client reads it
    (``"null or an integer in [0, 9223372036854775807]"``)."""
    return range_in_words(allowed, none="null")


def _invalid_message(field: str, exc: InvalidParameterError) -> str:
    """An ``InvalidParameterError``'s text for an HTTP client: its default form (``name=value is invalid: allowed
    ...``) with the body's field, the value in JSON and the range in JSON's words; a message of its own as is
    where it names the body's field."""
    if field == exc.parameter and str(exc) != str(InvalidParameterError(exc.parameter, exc.value, exc.allowed)):
        return str(exc)  # its own words (it was given a message=), where they name the body's field
    if exc.parameter == "structured":  # its value is the engine's summary of the spec ("regex: ..."), its range
        # the grammar library's own words: the field names what the client sent
        none, _, why = exc.allowed.partition("None: ")
        return f"`{field}` cannot be used with this model: {why}" if not none and why else \
            f"`{field}` is invalid: allowed {exc.allowed}"
    value = exc.value
    placeholder = isinstance(value, str) and value.startswith("<") and value.endswith(">") and " " in value
    # ``<9001 tokens>``: the engine's summary of a value too long to show, not the client's text
    return f"{field}={value if placeholder else shown(value)} is invalid: allowed {json_terms(exc.allowed)}"


def _prompt_too_long(field: str, exc: InvalidParameterError, also: Sequence[str] = ()) -> str | None:
    """The engine's "prompt of max_model_len tokens or more" as OpenAI words it (``This model's maximum context
    length is ...``), or None for another refusal of the prompt (one without its sizes: the count of chat messages,
    or a route's own). ``also``: the other body fields rendered into the prompt (a chat's ``tools``), named beside
    ``field`` as what to shorten."""
    if not isinstance(exc, PromptTooLongError) or exc.max_model_len is None:
        return None
    context = exc.max_model_len
    named = f"`{field}`" + "".join(f" and `{other}`" for other in also) + (" (rendered into the prompt)" if also else "")
    if exc.prompt_tokens is not None:
        got = f"your {named} resulted in {exc.prompt_tokens} tokens"
    elif exc.prompt_chars is not None:
        got = (f"your {named} {'have' if also else 'has'} {exc.prompt_chars} characters, more than {context - 1} "
               "tokens can hold")
    else:
        return None
    shorten = " or ".join(f"`{name}`" for name in (field, *also))
    return (f"This model's maximum context length is {context} tokens (prompt and output together), and the prompt "
            f"may take at most {context - 1} of them. However, {got}. Please reduce the length of {shorten}.")


MAX_LISTED_MODELS = 20  # served names a 404 lists (the rest are counted; GET /v1/models has them all)


def not_found(model: str, served: Sequence[str] = ()) -> APIError:
    """The 404 of a model this server does not serve, naming the ones it does (``served``, the names of
    ``GET /v1/models``): a client that asked for ``gpt-4o`` or a Hub id learns what to ask for instead."""
    shown = model if len(model) <= MAX_SHOWN_NAME else f"{model[:MAX_SHOWN_NAME]}... ({len(model)} characters)"
    names = ", ".join(f"`{name}`" for name in served[:MAX_LISTED_MODELS])
    more = len(served) - MAX_LISTED_MODELS
    names += f" and {more} more (GET /v1/models lists them)" if more > 0 else ""
    listed = f" This server serves: {names}." if served else " This server serves no model now."
    return APIError(404, f"The model `{shown}` does not exist.{listed}", param="model", code="model_not_found")


def unauthorized(got_key: bool) -> APIError:
    message = "Incorrect API key provided." if got_key else (
        "You didn't provide an API key. You need to provide your API key in an Authorization header "
        "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
    )
    return APIError(401, message, code="invalid_api_key" if got_key else None)


def metrics_unauthorized(got_key: bool) -> APIError:
    """The 401 of ``/metrics``: it takes an operator's metrics key, not an API key (no key is ever named)."""
    where = ("one of the server's metrics keys (ServerSettings.metrics_keys, asyncinfer serve --metrics-key, "
             "ASYNCINFER_METRICS_KEY), not an API key")
    message = (f"The key provided is not a metrics key: /metrics takes {where}." if got_key else
               f"You didn't provide a key: /metrics takes {where}, in an Authorization header using Bearer auth "
               "(i.e. Authorization: Bearer METRICS_KEY).")
    return APIError(401, message, code="invalid_api_key" if got_key else None)


def from_exception(exc: BaseException, request_id: str, rename: Callable[[str], str] = lambda p: p,
                   prompt_also: Sequence[str] = ()) -> APIError:
    """The API error for ``exc``; ``rename`` maps an engine parameter name to the body's field; ``prompt_also``
    names the body's other fields rendered into the prompt (a chat's ``tools``), which a too-long prompt's 400
    names beside its own field."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, engine_errors.EngineOverloadedError):
        retry = exc.retry_after or 1
        return APIError(503, f"The server is overloaded: {exc}", type="server_error", code="overloaded",
                        headers={"retry-after": str(max(1, round(retry)))})
    if isinstance(exc, RequestFailedError) and isinstance(exc.__cause__, InvalidParameterError):
        exc = exc.__cause__  # its own input failed it mid-way (a grammar the library gave up on): a 400
    if _is_template_error(exc):  # e.g. a template's raise_exception("roles must alternate")
        return APIError(400, f"The model's chat template refused these messages: {exc}", param=rename("prompt"))
    if isinstance(exc, InvalidParameterError):
        if exc.parameter == "structured" and _grammar_library_missing():  # the server lacks it: not the client's fault
            field = rename(exc.parameter)
            return APIError(501, f"`{field}` cannot be served here: this server has no structured output "
                                 "(its grammar library, llguidance, is not installed: pip install "
                                 "'asyncinfer[structured]').", type="server_error", param=field,
                            code="not_implemented", headers=NO_RETRY)
        if exc.parameter == "model":
            return APIError(404, str(exc), param="model", code="model_not_found")
        if exc.parameter == "prompt" and exc.allowed in _NO_CHAT:  # "messages=... allowed text" would misread
            if exc.value != "chat messages":  # a completion's text prompt: it is already on /v1/completions
                return APIError(400, _NO_TEXT, param=rename("prompt"))
            return APIError(400, _NO_CHAT[exc.allowed], param=rename("prompt"))
        against_context = isinstance(exc, MaxTokensOverContextError) or (
            isinstance(exc, PromptTooLongError) and exc.max_model_len is not None)
        # a route's own error in the engine's words (its range naming max_model_len) is one too
        code = "context_length_exceeded" if against_context or "max_model_len" in exc.allowed else None
        field = rename(exc.parameter)
        if exc.parameter == "max_tokens" and code is not None:
            return APIError(400, _no_room(field, exc), param=field, code=code)
        if exc.parameter == "prompt" and code is not None:
            too_long = _prompt_too_long(field, exc, prompt_also)
            if too_long is not None:
                return APIError(400, too_long, param=field, code=code)
        # the message names the body's field too (chat's `top_logprobs` is the engine's `logprobs`), in JSON's words
        return APIError(400, _invalid_message(field, exc), param=field, code=code)
    if isinstance(exc, ModelChangedError):  # swapped again and again while the request was made: come back
        return APIError(503, f"The model changed while the request was prepared: {exc}", type="server_error",
                        code="unavailable", headers={"retry-after": "1"})
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


def _no_room(field: str, exc: InvalidParameterError) -> str:
    """The engine's "prompt + max_tokens over max_model_len" in the terms of an HTTP body (the engine's
    own message suggests a ``SamplingParams`` option, which an HTTP client cannot set)."""
    leave = f"leave `{field}` out (the output then stops where the context ends)."
    if isinstance(exc, MaxTokensOverContextError) and exc.prompt_tokens is None:
        # checked before the prompt was tokenized: max_model_len - 1 is what a one-token prompt leaves, not this
        # prompt (its max_tokens of that size was the next 400, naming the prompt's own room)
        context = exc.max_model_len
        return (f"`{field}` is {shown(exc.value)}, but the context is {context} tokens (max_model_len), prompt and "
                f"output together: a prompt of one token leaves room for {context - 1} at most, a longer one less. "
                f"Lower `{field}` to at most {context} less the prompt's tokens, shorten the prompt, or " + leave)
    if not isinstance(exc, MaxTokensOverContextError):  # a route's own error in the engine's words: as it is
        return _invalid_message(field, exc)
    context, prompt = exc.max_model_len, exc.prompt_tokens
    room = f"at most max_model_len - prompt tokens = {context} - {prompt} = {context - prompt}"
    return (f"`{field}` is {shown(exc.value)}, but the prompt leaves room for {room} tokens. Lower `{field}`, "
            f"shorten the prompt, or " + leave)


def _grammar_library_missing() -> bool:
    from asyncinfer.grammar import library_missing

    return library_missing() is not None


def _is_template_error(exc: BaseException) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # no jinja2, no chat templates
        return False
    return isinstance(exc, TemplateError)


# ------------------------------------------------------------- app-level handlers
def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (no route for the URL, a method the route does not take) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    request_id = new_request_id()
    status = exc.status_code
    headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() in ("allow", "retry-after")}
    # the path as sent (the URL's path reads "OPTIONS *" as "/*"); a head may hold 64 KiB of either
    method, path = elided(request.method), elided(request.scope.get("path") or request.url.path)
    if status == 404:
        error = APIError(404, f"No route {method} {path} on this server{_other_api(request.url.path)}.",
                         code="unknown_url")
    elif status == 405:
        allowed = headers.get("Allow") or headers.get("allow") or ""
        error = APIError(405, f"{method} is not allowed on {path}"
                              + (f": use {allowed}." if allowed else "."), code="method_not_allowed", headers=headers)
    else:
        error = APIError(status, str(exc.detail), type="invalid_request_error" if status < 500 else "server_error",
                         headers=headers)
    return error.response(request_id)


#: Other servers' routes that clients of theirs call first, and this server's route for each.
_OTHER_ROUTES = {
    "/api/chat": "POST /v1/chat/completions", "/api/generate": "POST /v1/completions", "/api/tags": "GET /v1/models",
    "/api/embed": "POST /v1/embeddings", "/api/embeddings": "POST /v1/embeddings",
    "/v1/responses": "POST /v1/chat/completions",
}


def _other_api(path: str) -> str:
    """For a URL of Ollama's API (``/api/...``) or OpenAI's Responses API, what this server serves instead."""
    if path.startswith("/api/"):
        mapped = ", ".join(f"{route} is {ours}" for route, ours in _OTHER_ROUTES.items() if route.startswith("/api/"))
        return f": it serves OpenAI's API under /v1, not Ollama's ({mapped})"
    if path.rstrip("/") in ("", "/v1"):  # a browser, or a first curl, at the address serve printed
        return f": its routes are {_ROUTES}"
    if path.rstrip("/") == "/v1/responses":
        return ": OpenAI's Responses API is not served; send the conversation to POST /v1/chat/completions"
    if path.rstrip("/") in _UNDER_V1:  # an OpenAI client whose base_url lacks /v1, or llama.cpp's /completion
        return (f": the API is under /v1, at {_UNDER_V1[path.rstrip('/')]} (an OpenAI client's base_url ends in /v1: "
                "http://HOST:PORT/v1)")
    return ""


#: The routes of :func:`~asyncinfer.server.router.openai_router`, as the 404 of ``/`` and ``/v1`` lists them.
_ROUTES = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, GET /v1/models, GET /health and "
           "GET /metrics (docs/serving.md)")


#: Routes asked for without their /v1 (the base_url of an OpenAI client set to the bare server), or as llama.cpp's
#: server names them, and this server's route.
_UNDER_V1 = {"/chat/completions": "POST /v1/chat/completions", "/completions": "POST /v1/completions",
             "/completion": "POST /v1/completions", "/embeddings": "POST /v1/embeddings",
             "/models": "GET /v1/models"}


def elided(text: str) -> str:
    """A method or a URL's path as an error echoes it: cut past ``MAX_SHOWN_NAME`` characters, with its length."""
    return text if len(text) <= MAX_SHOWN_NAME else f"{text[:MAX_SHOWN_NAME]}... ({len(text)} characters)"


def internal_error(request: Request, exc: Exception) -> Response:
    """A fault no route turned into an answer: logged with its id, a 500 without a traceback."""
    request_id = new_request_id()
    return from_exception(exc, request_id).response(request_id)


def validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's check of a route's declared parameters, as a 400 (OpenAI's status for a bad request)."""
    request_id = new_request_id()
    return APIError(400, f"The request is invalid: {exc}").response(request_id)
