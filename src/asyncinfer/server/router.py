"""``openai_router(engine)``: the OpenAI-compatible routes, as a FastAPI router any app includes.

Everything a route answers is built here, errors included: a router cannot
install exception handlers in the app that includes it, so each route checks the
key, reads the body (bounded), parses it and calls the engine inside one
``try`` that turns any failure into an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import itertools
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from asyncinfer import intake
from asyncinfer.embedding import EmbeddingPlan
from asyncinfer.engine import AsyncEngine, EngineState
from asyncinfer.errors import EngineClosedError, InvalidParameterError, ModelChangedError
from asyncinfer.holder import LOADING_NEXT, ModelVersionInfo
from asyncinfer.outputs import StreamDelta
from asyncinfer.prompts import (
    MAX_CHAT_MESSAGES,
    MAX_PRIORITY,
    MIN_PRIORITY,
    OFF_LOOP_CHARS,
    LoopShare,
    prompt_cost,
    texts_cost,
)
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.server import _engine
from asyncinfer.server.auth import bearer, single_header
from asyncinfer.server.errors import (
    NO_RETRY,
    APIError,
    from_exception,
    metrics_unauthorized,
    new_request_id,
    not_found,
    shown,
)
from asyncinfer.server.metrics import exposition, metrics_registry
from asyncinfer.server.protocol import (
    CHAT_BODY,
    COMPLETION_BODY,
    EMBEDDING_BODY,
    MAX_JSON_DEPTH,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    check_body_utf8,
    decode_json,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from asyncinfer.server.responses import SSE_DONE, Reply, sse
from asyncinfer.server.settings import MAX_TENANT_CHARS, ServerSettings, check_tenant_name
from asyncinfer.server.streaming import ClientGone, EventStream, MergedStreams, gather_all, unless_disconnected
from asyncinfer.server.tool_formats import ToolFormats, render_chat
from asyncinfer.threads import WorkShares

__all__ = ["MAX_JSON_DEPTH", "decode_json", "openai_router"]

_B = TypeVar("_B")
EngineRef = AsyncEngine | Callable[[], AsyncEngine]
_PRIORITY = re.compile(r"-?[0-9]+")  # a priority header's value: an optional "-" and ASCII digits
#: What a call lets through unanswered: an exit, an interrupt, a cancellation (every other exception is answered).
_EXITS = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)
#: How many times a chat is made again (its format chosen, its prompt rendered or counted) or a completion (its prompts
#: counted, or its logprobs to be read with the version's tokenizer) for a model swapped while it was made, before its
#: ModelChangedError is answered (a 503 to retry).
MAX_REBINDS = 3
#: About the characters one float of an embedding takes in a JSON answer (its cost, as LoopShare counts it).
_FLOAT_CHARS = 20
CLIENT_CLOSED = 499  # nobody reads it: the client is gone (nginx's code, for the logs)

#: The model an endpoint needs (its article, its kind's words) and how a server's operator adds one, for the 404 of
#: a server that serves none of that kind (a client following a guide to /v1/embeddings met only "This server has
#: no embedding model.", a model named there "does not exist", with no word of what would serve it).
_NO_MODEL_OF = {
    "embed": ("an", "embedding model", ("/v1/embeddings needs one, which the server's operator adds with "
                                        "`asyncinfer serve --embedding-model all-MiniLM-L6-v2` (or a ModelSpec of a "
                                        "sentence encoder in create_app).")),
    "generate": ("a", "generation model", ("the chat and completions routes need one, which the server's operator "
                                           "adds with `asyncinfer serve MODEL` (or a ModelSpec of a generator in "
                                           "create_app).")),
}


def openai_router(engine: EngineRef, settings: ServerSettings | None = None) -> APIRouter:
    """The OpenAI-compatible routes over ``engine``, for ``app.include_router(...)``.

    ``engine``: a started (or to-be-started) :class:`AsyncEngine`, or a callable
    returning it at request time (for an engine created later, e.g. in a lifespan).
    The app owns the engine's lifecycle: start it in the app's lifespan, on the
    loop that serves the requests. Routes: ``POST /v1/chat/completions``,
    ``POST /v1/completions``, ``POST /v1/embeddings``, ``GET /v1/models``,
    ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics`` (each GET also answers HEAD).
    """
    api = _OpenAI(engine if callable(engine) and not isinstance(engine, AsyncEngine) else (lambda: engine),
                  settings or ServerSettings())
    router = APIRouter()
    router.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", api.completions, methods=["POST"])
    router.add_api_route("/v1/embeddings", api.embeddings, methods=["POST"])
    # HEAD as GET, without the body (the ASGI server leaves it out), as for any GET of HTTP's
    router.add_api_route("/v1/models", api.models, methods=["GET", "HEAD"])
    router.add_api_route("/v1/models/{model:path}", api.model, methods=["GET", "HEAD"])
    router.add_api_route("/health", api.health, methods=["GET", "HEAD"])
    router.add_api_route("/metrics", api.metrics, methods=["GET", "HEAD"])
    return router


class _Failed:
    """What :func:`_outcome` hands back for a call that raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _outcome(work: Callable[[], _B]) -> _B | _Failed:
    """``work()``, or what it raised as a :class:`_Failed` (in a worker thread)."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - raised again on the loop by the caller
        return _Failed(exc)


@dataclass(frozen=True)
class _Call:
    """One HTTP call: its id (also the engine's request id), the raw request, who made it."""

    id: str
    request: Request
    key: str | None  # the API key it was made with (None when the server asks for none)
    cache_salt: str | None
    #: whose worker threads its off-loop work takes (:class:`~asyncinfer.threads.WorkShares`): its key's tenant, a
    #: trusted tenant header's, else its key's (the body's ``user`` is read only after the body's decoding)
    party: Hashable = None
    #: what gives its tenant's places back (``max_requests_per_tenant``): at its answer's end, once
    places: list[Callable[[], None]] = field(default_factory=list)

    def give_back(self) -> None:
        while self.places:
            self.places.pop()()


@dataclass(frozen=True)
class _Generation:
    engine: AsyncEngine
    model: str
    params: SamplingParams
    reply: Reply
    args: dict[str, Any]  # generate()/stream() keywords: priority, cache_salt, model
    ids: list[str]  # the engine's request ids, one per prompt
    version_id: int  # the model's version whose tokenizer ``reply`` decodes logprobs with

    def pin(self) -> None:
        """Run on the version ``version_id`` only (its tokenizer made what the router hands the engine, or reads
        what the engine gives back): a swap that lands first is :class:`ModelChangedError`, nothing queued."""
        self.args["version_id"] = self.version_id


class _OpenAI:
    def __init__(self, engine: Callable[[], AsyncEngine], settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.created = int(time.time())
        self.answers: Counter[tuple[str, int]] = Counter()
        # generation requests in flight by tenant (or key, without one), for ServerSettings.max_requests_per_tenant
        self.in_flight: Counter[tuple[str, str | None]] = Counter()
        self.registry = metrics_registry(engine, self.answers)
        self.tool_formats = ToolFormats()  # each served model's tool format, chosen once per loaded version
        # what this server decodes, renders and counts on the loop in one turn of it, all calls together
        # (as the engine's own share bounds its tokenizing): a burst of calls, each short, would hold it for their sum
        self.loop_share = LoopShare(OFF_LOOP_CHARS)
        # the worker threads of that work past the share: each tenant's (key's) few at once, the rest in turn
        self.work_shares = WorkShares()
        # the long chats this server renders itself (a tools chat, a stream's usage count) take their turns here, as
        # the engine's take theirs in its intake (asyncinfer.intake): a flood of them waits, not its neighbours
        self.chat_turns = intake.Turns(intake.CHAT_MESSAGES_PER_S, 2 * MAX_CHAT_MESSAGES)  # the rate as set now
        # the headers a generation's decisions read besides the key and the body's type (the tenant header only where
        # the settings read it): a request giving one of them twice is a 400 (auth.single_header), after the key
        reads_tenant = settings.tenant_from == "header" or settings.cache_isolation == "header"
        self._generation_headers = (*((settings.tenant_header,) if reads_tenant else ()),
                                    *(() if settings.priority_header is None else (settings.priority_header,)))

    # ------------------------------------------------------------------ routes
    async def chat_completions(self, request: Request) -> Response:
        return await self._call(request, "chatcmpl", parse_chat, self._chat, ChatRequest.rename, shape=CHAT_BODY,
                                generation=True)

    async def completions(self, request: Request) -> Response:
        return await self._call(request, "cmpl", parse_completion, self._complete, CompletionRequest.rename,
                                shape=COMPLETION_BODY, generation=True)

    async def embeddings(self, request: Request) -> Response:
        return await self._call(request, "embd", parse_embedding, self._embed, shape=EMBEDDING_BODY)

    async def models(self, request: Request) -> Response:
        return await self._call(request, "models", None, lambda _body, _call: self._models())

    async def model(self, request: Request, model: str) -> Response:
        return await self._call(request, "models", None, lambda _body, _call: self._models(model))

    async def metrics(self, request: Request) -> Response:
        async def scrape(_body: None, _call: _Call) -> Response:
            return Response(exposition(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")
        return await self._call(request, "metrics", None, scrape, authorize=self._authorize_metrics)

    async def health(self, request: Request) -> Response:
        """Open to all: 200 while the engine serves, 503 (with its state) otherwise."""
        try:
            state = self.engine().state.value
        except EngineClosedError:  # no engine yet (starting) or any more (stopping)
            state = "starting"
        ok = state == EngineState.RUNNING.value
        response = _json({"status": "ok" if ok else state}, 200 if ok else 503)
        response.headers["x-request-id"] = new_request_id("health")
        return self._answer(request, response)

    # ------------------------------------------------------------- the wrapper
    async def _call(
        self,
        request: Request,
        prefix: str,
        parse: Callable[[Any], _B] | None,
        run: Callable[[_B, _Call], Awaitable[Response]],
        rename: Callable[[str], str] = lambda p: p,
        authorize: Callable[[Request], str | None] | None = None,
        shape: type[msgspec.Struct] | None = None,
        generation: bool = False,
    ) -> Response:
        """``generation``: the call generates, reading the tenant and priority headers (where the settings name
        them) and the cache salt."""
        call_id = new_request_id(prefix)
        call: _Call | None = None
        prompt_also: tuple[str, ...] = ()  # a chat's other fields in its prompt (its tools), for a too-long 400
        try:
            key = (authorize or self._authorize)(request)  # first: a caller without a key learns only its 401
            # each header read below, given once (before any of them decides anything); only those this call reads
            for name in (*(("content-type",) if parse is not None else ()),
                         *(self._generation_headers if generation else ())):
                single_header(request, name)
            call = _Call(call_id, request, key, self._cache_salt(request, key) if generation else None,
                         self._party(request, key))
            body = await self._body(request, parse, shape, call.party) if parse is not None else None
            if isinstance(body, (ChatRequest, CompletionRequest)):
                rename = body.field  # names its own token-limit field (max_tokens or max_completion_tokens)
            if isinstance(body, ChatRequest):
                prompt_also = body.prompt_also
            response = await run(body, call)  # type: ignore[arg-type]
        except ClientGone:
            response = Response(status_code=CLIENT_CLOSED)
        except _EXITS:
            if call is not None:
                call.give_back()
            raise
        # every call is answered: from_exception logs an unknown one, a 500; a native library's panic too (pyo3's
        # PanicException derives from BaseException only: it went to the ASGI server, a plain-text 500)
        except BaseException as exc:  # noqa: BLE001
            response = from_exception(exc, call_id, rename, prompt_also).response(call_id)
        if call is not None and not isinstance(response, EventStream):  # a stream gives them back as it closes
            call.give_back()
        response.headers.setdefault("x-request-id", call_id)
        return self._answer(request, response)

    def _answer(self, request: Request, response: Response) -> Response:
        route = request.scope.get("route")
        self.answers[(getattr(route, "path", request.url.path), response.status_code)] += 1
        if self.settings.instance_id is not None:
            response.headers["x-asyncinfer-instance"] = self.settings.instance_id
        return response

    def _authorize(self, request: Request) -> str | None:
        """The caller's API key (None when the server asks for none); 401 when it is wrong or missing."""
        keys = self.settings.accepted_keys
        return bearer(request, keys) if keys else None

    def _authorize_metrics(self, request: Request) -> str | None:
        """``/metrics`` takes an operator's key (``metrics_keys``), never a tenant's: one tenant's
        scrape would show the others' figures (their prefix-cache hits, their tokens)."""
        if self.settings.metrics_keys:
            bearer(request, self.settings.metrics_keys, metrics_unauthorized)
        elif self.settings.accepted_keys:
            raise APIError(403, "/metrics is off on a server with API keys unless an operator's key is named for "
                                "it (ServerSettings.metrics_keys, asyncinfer serve --metrics-key, "
                                "ASYNCINFER_METRICS_KEY).", code="metrics_key_required")
        return None

    def _cache_salt(self, request: Request, key: str | None) -> str | None:
        mode = self.settings.cache_isolation
        if mode == "api-key" and key is not None:
            return "key:" + hashlib.sha256(key.encode()).hexdigest()
        if mode == "header":
            tenant = self._tenant_header(request)
            return None if tenant is None else "tenant:" + tenant
        return None

    def _identity(self, call: _Call, body: ChatRequest | CompletionRequest) -> tuple[str | None, int]:
        """The tenant (heading the engine request ids) and the priority of a generation call, by the
        deployment's policy (``ServerSettings.tenant_from``): from the request itself only when trusted."""
        settings = self.settings
        owner = settings.tenants.get(call.key) if settings.tenant_from == "api-key" and call.key else None
        priority: int | None = None
        if settings.tenant_from == "request":
            priority = body.priority
        elif body.priority is not None:
            raise APIError(400, "This server sets request priorities by its own policy: `priority` is not "
                                "accepted in requests.", param="priority", code="unsupported_parameter")
        tenant = self._tenant(call, body.user)
        if priority is None and settings.priority_header is not None:
            raw = call.request.headers.get(settings.priority_header)
            if raw is not None:
                try:
                    if not _PRIORITY.fullmatch(raw):  # not int()'s "+3", " 7 " or "1_000"
                        raise ValueError(raw)
                    priority = int(raw)
                    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:  # the engine's range: refused here, by the
                        raise ValueError(raw)  # header's name (the engine's error named a body field, `priority`)
                except ValueError:
                    raise APIError(400, f"The `{settings.priority_header}` header must be an integer in "
                                        f"[{MIN_PRIORITY}, {MAX_PRIORITY}], got {raw[:32]!r}.",
                                   code="invalid_priority") from None
        if priority is None:
            priority = owner.priority if owner is not None else settings.tenant_priorities.get(tenant or "", 0)
        return tenant, priority

    def _tenant(self, call: _Call, user: str | None) -> str | None:
        """The call's tenant by the deployment's policy (``ServerSettings.tenant_from``): its key's ``Tenant``, the
        tenant header, or (only where the deployment trusts its callers) the body's ``user``; None without one."""
        settings = self.settings
        if settings.tenant_from == "request":
            return None if user is None else check_tenant_name(user, "user")
        if settings.tenant_from == "api-key":
            return self._key_tenant(call.key)
        return self._tenant_header(call.request)

    def _key_tenant(self, key: str | None) -> str | None:
        """The tenant that API key ``key`` belongs to (``ServerSettings.tenants``); None for no key or one without."""
        owner = self.settings.tenants.get(key) if key else None
        return None if owner is None else owner.name

    def _embedding_tenant(self, call: _Call, user: str | None) -> str | None:
        """Whom an embedding call's texts are batched as (``AsyncEngine.embed``'s ``tenant``: the batches take the
        tenants in turn): its tenant, else its API key (:func:`_group`), as ``max_requests_per_tenant`` counts a
        generation's places."""
        if self.settings.tenant_from == "header":
            single_header(call.request, self.settings.tenant_header)  # a 400 when given twice, as for a generation
        return _group(self._tenant(call, user), call.key)

    def _take_places(self, call: _Call, tenant: str | None, prompts: int, n: int = 1) -> None:
        """The caller's places (``max_requests_per_tenant``; its tenant's, else its key's) for ``prompts`` prompts of
        ``n`` samples each, one place a sample (each takes a seat of ``max_num_seqs`` as it runs: counted a prompt,
        ``n=4`` let a tenant limited to 1 hold four seats), held until the call's answer ends (``call.give_back``): a
        400 for more than the limit at once, a 429 past what is left. A call takes them once (a chat made again for
        a swapped model keeps them)."""
        limit = self.settings.max_requests_per_tenant
        if limit is None or call.places:
            return
        count = prompts * n
        if count > limit:
            makes = (f"{count} requests (one a prompt)" if n == 1 else
                     f"{count} requests ({prompts} prompt{'s' if prompts > 1 else ''} of n={n} samples, one a sample)")
            raise APIError(400, f"This call makes {makes}, more than the {limit} this server lets one tenant have in "
                                f"flight (max_requests_per_tenant={limit}).",
                           param="prompt" if prompts > limit else "n",
                           code="tenant_requests_exceeded")
        who = ("tenant", tenant) if tenant is not None else ("key", call.key)
        held = self.in_flight[who]
        if held + count > limit:
            more = "" if count == 1 else f" and this call makes {count} more"
            # a call with neither tenant nor key (a server without API keys) shares one count with all such calls
            holder = ("This tenant has" if tenant is not None else "This API key (which has no tenant) has"
                      if call.key is not None else "Calls without a tenant or an API key, which share one count, have")
            raise APIError(429, f"{holder} {_requests(held)} in flight{more}, the most this server allows one "
                                f"tenant (max_requests_per_tenant={limit}): retry when one has ended.",
                           type="rate_limit_error", code="tenant_requests_exceeded", headers={"retry-after": "1"})
        self.in_flight[who] = held + count

        def give_back() -> None:
            left = self.in_flight[who] - count
            if left > 0:
                self.in_flight[who] = left
            else:
                del self.in_flight[who]
        call.places.append(give_back)

    def _party(self, request: Request, key: str | None) -> Hashable:
        """Whose worker threads a call's off-loop work takes, known before its body is read (``_Call.party``): its
        key's tenant (``tenant_from="api-key"``), the tenant header where the deployment trusts it (a header to be
        refused later counts as none), else its key; with neither (a server without API keys), None: the work threads
        as the work comes, there being nobody to tell apart (one share for all held every caller's body behind two
        callers' long logprobs answers)."""
        settings = self.settings
        tenant: str | None = None
        if settings.tenant_from == "api-key":
            tenant = self._key_tenant(key)
        elif settings.tenant_from == "header":
            # one copy, as the call's checks will take it: of two, the first may be a client's own, sent ahead of the
            # copy a proxy appends (an embeddings call, whose check comes after its body, decoded the body, up to
            # max_body_bytes, in the threads of the tenant its caller named, then was refused)
            named = request.headers.getlist(settings.tenant_header)
            tenant = named[0] if len(named) == 1 and 0 < len(named[0]) <= MAX_TENANT_CHARS \
                and named[0].isprintable() else None
        if tenant is not None:
            return ("tenant", tenant)
        return None if key is None else ("key", key)

    def _tenant_header(self, request: Request) -> str | None:
        """The ``tenant_header`` value (None when absent); a 400 when it is empty, over MAX_TENANT_CHARS or holds a
        character that is not printable (a tab, or a byte 0x80-0x9F read as a C1 control character)."""
        tenant = request.headers.get(self.settings.tenant_header)
        if tenant is not None and (not 0 < len(tenant) <= MAX_TENANT_CHARS or not tenant.isprintable()):
            raise APIError(400, f"The `{self.settings.tenant_header}` header must be 1 to {MAX_TENANT_CHARS} "
                                "printable characters.", code="invalid_tenant")
        return tenant

    async def _body(self, request: Request, parse: Callable[[Any], _B], shape: type[msgspec.Struct] | None,
                    party: Hashable = None) -> _B:
        """The body, read (refused with a 413 once it grows past ``max_body_bytes``), decoded as JSON into
        ``shape`` (its endpoint's fields, :func:`~asyncinfer.server.protocol.decode_json`: bulk in fields the
        server ignores is skipped, never built) and checked by ``parse``; a body over ``OFF_LOOP_CHARS`` bytes is decoded and checked in a worker
        thread (a few MiB of JSON, or thousands of messages, would hold the loop for everyone). A body
        declared as anything but JSON is a 415, unread."""
        _check_json_type(request.headers.get("content-type"))
        # every copy of the header, as one list (RFC 9110): the first alone was read, so `identity` then `gzip` was
        # read as plain and the gzip bytes answered as malformed JSON
        codings = request.headers.getlist("content-encoding")
        if codings and any(c.strip().lower() != "identity" for value in codings for c in value.split(",")):
            encoding = ", ".join(codings)
            raise APIError(415, f"The request body must not be encoded: Content-Encoding {encoding[:100]!r} is not "
                                "supported (send it as plain JSON).", code="unsupported_content_encoding")
        _check_transfer_coding(request.headers.getlist("transfer-encoding"))
        limit = self.settings.max_body_bytes
        # made as raised, never a local: a local error's traceback holds the frame that holds it (and the chunks read
        # so far, up to the limit), a cycle only a full garbage collection frees (tests/server/test_fresh_pass33.py)
        def too_large() -> APIError:
            return APIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                            code="request_too_large")
        # its ASCII digits, leading zeros dropped: the HTTP parser takes "000...02" (4,301 digits, past what int()
        # reads: a ValueError, answered 500) as 2
        declared = request.headers.get("content-length", "").lstrip("0")
        if declared.isascii() and declared.isdigit() and (len(declared) > len(str(limit)) or int(declared) > limit):
            raise too_large()
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large()
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone from None
        raw = b"".join(chunks)

        def decoded() -> _B:
            body = parse(decode_json(raw, shape))
            check_body_utf8(raw)  # what no field's check read: the first copy of a key given twice
            return body
        return await self._off_loop_if_long(party, len(raw), decoded)

    async def _off_loop_if_long(self, party: Hashable, chars: int, work: Callable[[], _B]) -> _B:
        """``work()`` (of cost ``chars``) on the loop when it fits what is left of this turn's share
        (:class:`~asyncinfer.prompts.LoopShare`, ``OFF_LOOP_CHARS`` for all calls together), else in a worker
        thread, one of ``party``'s (:class:`~asyncinfer.threads.WorkShares`): a long input, or a short one that comes
        after others in the same turn."""
        if self.loop_share.take(chars):
            return work()
        # the worker hands back its error as a value: raised through the thread's future, the error's traceback held
        # the frame awaiting that future, which holds the future, which holds the error, a cycle only a full garbage
        # collection frees, and with it all the error's frames held (a refused 4 MiB body: 50 MB each, kept until
        # then; tests/server/test_fresh_pass32.py)
        # a client gone meanwhile: its thread held till the work ends
        outcome = await self.work_shares.run(party, _outcome, work)
        if isinstance(outcome, _Failed):
            error = outcome.error
            del outcome
            try:
                raise error
            finally:
                del error
        return outcome

    # ------------------------------------------------------------------ models
    def _served(self) -> dict[str, ModelVersionInfo]:
        """Each served name's info (its current version's while a swap drains the old one). A model being removed
        is left out: it stays in ``model_info()`` ("draining") until its last request ends, but takes no new one."""
        engine = self.engine()
        named: dict[str, ModelVersionInfo] = {}
        for info in engine.model_info():
            if info.name not in named or info.state == "current":
                named[info.name] = info
        # a generator between the versions of a drain-mode swap (from its call on) is left out, as its requests are
        # answered 503 then: its old version, still listed "current" during the swap's checks or "draining" while it
        # ends its requests, takes no new one (GET /v1/models/<it> is that 503 too; serving.md)
        return {name: info for name, info in named.items()
                if (info.state == "current" or _engine.serves(engine, name))
                and not (info.kind == "generate" and _engine.between_versions(engine, name))}

    def _pick(self, requested: str | None, kind: str) -> tuple[str, ModelVersionInfo]:
        """The model a body names (or the first of ``kind``); 404 when there is none by that name."""
        served = self._served()
        if requested is None:
            # the engine's default generator (its first loaded) is in no model_info() entry between the versions of
            # a drain-mode swap: the first generator listed then is another model, which must not answer for it
            if kind == "generate" and _engine.between_versions(self.engine(), None):
                # a hint only where another generator would answer (an embedding model is a 400 on this route; the
                # default model's old version, listed "draining" while the swap waits for its requests, is no other)
                others = ", ".join(f"`{name}`" for name, info in served.items() if info.kind == "generate"
                                   and not _engine.between_versions(self.engine(), name))
                hint = f", or name another generator: {others}" if others else ""
                raise self._unserved(None, hint)
            found = next((info for info in served.values() if info.kind == kind), None)
            if found is None:
                _article, noun, how = _NO_MODEL_OF[kind]
                raise APIError(404, f"This server has no {noun}: {how}",
                               param="model", code="model_not_found")
            return found.name, found
        if kind == "generate" and _engine.between_versions(self.engine(), requested):
            # listed still (its old version drains, or the swap checks the new one), but no version takes requests
            # until the new one serves: come back, not held for the whole swap (docs/model_swaps.md)
            raise self._absent(requested)
        info = served.get(requested)
        if info is None:
            absent = self._absent(requested)
            if absent.status == 404 and served and all(m.kind != kind for m in served.values()):
                article, noun, how = _NO_MODEL_OF[kind]
                raise APIError(404, f"{absent.message} None of them is {article} {noun}: {how}", param="model",
                               code="model_not_found")
            try:  # held by no local as raised: its traceback holds this frame (and the frames of the call above, its
                # body), a cycle only a full garbage collection frees (tests/server/test_fresh_pass33.py)
                raise absent
            finally:
                del absent
        if info.kind != kind:
            use = "/v1/embeddings" if info.kind == "embed" else "/v1/chat/completions or /v1/completions"
            message = f"The model `{requested}` does not support this endpoint: use {use}."
            if all(m.kind != kind for m in served.values()):  # and no model here does: say how one is added
                _article, noun, how = _NO_MODEL_OF[kind]
                message += f" This server has no {noun}: {how}"
            raise APIError(400, message, param="model")
        return requested, info

    async def _models(self, model: str | None = None) -> Response:
        if model == "":  # /v1/models/: the list's URL with a trailing slash, as every other route's is (no redirect)
            raise APIError(404, "No route /v1/models/ on this server: the list of models is GET /v1/models (no "
                                "trailing slash), one model GET /v1/models/NAME.", code="unknown_url")
        cards = {name: self._card(info) for name, info in self._served().items()}
        if model is None:
            return _json({"object": "list", "data": list(cards.values())})
        if model not in cards:
            raise self._absent(model)
        return _json(cards[model])

    def _absent(self, model: str) -> APIError:
        """A model no ``model_info()`` entry names: a 503 to come back shortly while it is between versions of a
        drain-mode swap (it is still served: a 404 told clients it was gone), else a 404."""
        if _engine.between_versions(self.engine(), model):
            return self._unserved(model)
        return not_found(model, list(self._served()))

    def _unserved(self, model: str | None, hint: str = "") -> APIError:
        """The 503 for a generator with no version serving: between the versions of a drain-mode swap, to retry
        shortly; or left without one (the swap's new version and the reload of its old one both failed), which no
        retry mends until an operator loads one: said so, without Retry-After (clients retried it for ever)."""
        named = "The default model" if model is None else f"The model `{model}`"
        why = _engine.vacancy(self.engine(), model) or ""
        if not why or LOADING_NEXT in why:
            return APIError(503, f"{named} is between versions ({LOADING_NEXT}): retry shortly{hint}.",
                            param="model", type="server_error", code="unavailable", headers={"retry-after": "1"})
        why = why.removeprefix("no model version is serving (").removesuffix(")")
        return APIError(503, f"{named} has no version serving: {why}; a retry gets this answer until one is "
                             f"loaded{hint}.", param="model", type="server_error", code="model_not_serving",
                        headers=NO_RETRY)

    def _card(self, info: ModelVersionInfo) -> dict[str, Any]:
        card = {"id": info.name, "object": "model", "created": self.created, "owned_by": "asyncinfer",
                "kind": info.kind}
        plan = info.memory_plan  # a generator's max_model_len; an embedding model's tokens read per text
        card["max_model_len"] = plan.max_seq_len if isinstance(plan, EmbeddingPlan) else plan.max_model_len
        return card

    # -------------------------------------------------------------- generation
    def _generation(self, body: ChatRequest | CompletionRequest, call: _Call, chat: bool, count: int,
                    attempt: int = 1) -> _Generation:
        """What a generation call needs: its model, parameters, reply builder, engine arguments and ids (``attempt``:
        made again after a swap; its ids are new, since requests of the earlier attempt may still hold theirs).
        With logprobs, the reply decodes their tokens with the serving version's tokenizer, and the call is pinned
        to that version: a swap that landed before the request was bound ran it on the new version, whose token
        ids the old tokenizer read as other tokens (``tests/server/test_fresh_pass23.py``)."""
        engine = self.engine()
        model, info = self._pick(body.model, "generate")
        params = body.sampling_params(info.memory_plan.max_model_len)
        want_logprobs = params.logprobs is not None
        tokenizer = _engine.generator_tokenizer(engine, model) if want_logprobs else None
        reply = Reply(chat, call.id, int(time.time()), model, tokenizer, want_logprobs, body.include_usage,
                      body.tool_use if isinstance(body, ChatRequest) else None,
                      token_ids=not chat and _engine.without_tokenizer(engine, model))
        tenant, priority = self._identity(call, body)
        if self.settings.max_requests_per_tenant is not None and not call.places:
            # what no retry could run is its 400 before the tenant's places are counted (a tenant at its limit got a
            # 429 with Retry-After for a token id past the vocabulary, a stop token id past it, an n past max_num_seqs)
            for prompt in (body.messages,) if isinstance(body, ChatRequest) else body.prompts:
                engine.check_request(prompt, params, model=model)
        self._take_places(call, tenant, count, params.n)
        # With a tenant, request ids are ``<tenant>/<call id>``: the convention that per-tenant schedulers
        # read (examples/custom_scheduler.py), the name escaped so that distinct tenants never share a
        # prefix. One id per prompt.
        base = f"{_escape_tenant(tenant)}/{call.id}" if tenant is not None else call.id
        if attempt > 1:
            base = f"{base}.{attempt}"
        ids = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
        # the engine's ``tenant`` (whose turns a structured request's grammar compile takes), as an embedding's
        args = {"priority": priority, "cache_salt": call.cache_salt, "model": model, "tenant": _group(tenant, call.key)}
        g = _Generation(engine, model, params, reply, args, ids, info.version_id)
        if want_logprobs:
            g.pin()
        return g

    @staticmethod
    async def _on_one_version(make: Callable[[int], Awaitable[Response]]) -> Response:
        """``make(attempt)``, made again for the new version when a model swap lands while it is made (its
        :class:`ModelChangedError`), up to :data:`MAX_REBINDS` times before that error is answered."""
        for attempt in itertools.count(1):
            try:
                return await make(attempt)
            except ModelChangedError:
                if attempt == MAX_REBINDS:
                    raise

    async def _chat(self, body: ChatRequest, call: _Call) -> Response:
        # a swap came while it was rendered: rendered again for the new version
        try:
            return await self._on_one_version(lambda attempt: self._chat_on_one_version(body, call, attempt))
        except InvalidParameterError as exc:
            if exc.parameter == "structured" and body.structured_field == "tools" and body.tool_use is not None:
                # the calls' grammar was refused: llguidance's words name its parts (`arguments`), not the tool
                try:
                    refused = await self.work_shares.run(call.party, body.tool_use.refused_tool)
                except Exception:  # noqa: BLE001 - naming the tool is a courtesy: the grammar's own refusal stands
                    refused = None
                if refused is not None:
                    name, reason = refused
                    raise APIError(400, f"`tools`: the `parameters` of function {shown(name)} are refused: {reason}. "
                                        "Give a JSON schema that some arguments satisfy.", param="tools") from None
            raise

    async def _chat_on_one_version(self, body: ChatRequest, call: _Call, attempt: int) -> Response:
        """``_chat`` with what the router makes for the model's current version (the tool format, a prompt it
        renders or counts) pinned to that version: a swap that lands meanwhile is :class:`ModelChangedError`,
        nothing queued."""
        engine = self.engine()
        model, info = self._pick(body.model, "generate")
        fmt = self.tool_formats.of(model, info.version_id, lambda: _engine.generator_tokenizer(engine, model))
        body = body.in_format(fmt)  # its tools bound to the model's format, a forced call in its syntax
        g = self._generation(body, call, True, 1, attempt)
        prompt: Any = body.messages
        rendered = fmt.renders_history and (body.tool_use is not None or body.has_tool_turns)
        counted = body.stream and body.include_usage and not rendered
        if rendered or counted or body.tool_use is not None:  # made for this version (its format, template or
            # tokenizer): run by it, or made again
            g.pin()
        if rendered or counted:  # rendered here (a tools chat: the family's template describes the tools and renders
            # the calls and results; a stream's prompt count) once the messages' characters alone could fit, before
            # its turn: a tools chat of megabytes was rendered and tokenized whole, seconds, to be refused (pass39)
            g.engine.check_prompt_size(body.messages, model=g.model)
        # its messages and the tool calls they hold (the history's: the template renders each)
        size = intake.chat_turn_size(body.history) if rendered else intake.chat_turn_size(body.messages)
        waits = (rendered or counted) and size > intake.CHAT_FREE_MESSAGES
        # a long chat takes a place of the engine's admission control (refused at once when it is full, not after
        # the wait) and holds it while it waits and is rendered: any number of them waited here uncounted
        with g.engine.taking_in(model=g.model) if waits else contextlib.nullcontext():
            if waits:  # rendered here, so the engine takes no turn for it; a client gone meanwhile ends the wait
                await unless_disconnected(call.request, self.chat_turns.wait(size))
            if rendered:
                tokenizer = _engine.generator_tokenizer(g.engine, g.model)
                prompt = await self._off_loop_if_long(call.party, prompt_cost(body.messages), lambda: render_chat(
                    tokenizer, fmt, body.history, body.tool_use))
            elif counted:  # a stream's deltas carry no prompt count: render the template once, here
                prompt = await self._off_loop_if_long(call.party, prompt_cost(body.messages),
                                                 lambda: g.engine.apply_chat_template(body.messages, model=g.model))
        if not body.stream:
            out = await unless_disconnected(
                call.request, g.engine.generate(prompt, g.params, request_id=g.ids[0], **g.args))
            return await self._whole(call, g.reply, lambda: g.reply.completion(
                [g.reply.choice(c.index, c.text, c.logprobs, c.finish_reason) for c in out.outputs],
                len(out.prompt_token_ids), _tokens(out.outputs)))
        stream = g.engine.stream(prompt, g.params, request_id=g.ids[0], **g.args)
        return await self._stream(call, g.reply, [stream], g.params.n, len(prompt) if body.include_usage else 0,
                                  body.field)

    async def _complete(self, body: CompletionRequest, call: _Call) -> Response:
        # a swap came before its requests were bound: made again for the new version
        return await self._on_one_version(lambda attempt: self._complete_on_one_version(body, call, attempt))

    async def _complete_on_one_version(self, body: CompletionRequest, call: _Call, attempt: int) -> Response:
        """``_complete`` pinned to the model's current version where the router reads or makes tokens with its
        tokenizer (logprobs; the prompts it counts for a stream's usage)."""
        g = self._generation(body, call, False, len(body.prompts), attempt)
        n = g.params.n
        if len(body.prompts) > 1:  # refused whole (400: never fits; 503: not now), never half queued then aborted
            g.engine.check_admission(len(body.prompts), model=g.model)
        if not body.stream:
            outs = await unless_disconnected(call.request, gather_all(
                [g.engine.generate(p, g.params, request_id=rid, **g.args) for p, rid in zip(body.prompts, g.ids)]))
            prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
            return await self._whole(call, g.reply, lambda: g.reply.completion(
                [g.reply.choice(i * n + c.index, c.text, c.logprobs, c.finish_reason, c.token_ids)
                 for i, out in enumerate(outs) for c in out.outputs],
                prompt_tokens, sum(_tokens(out.outputs) for out in outs)))
        prompts = body.prompts
        if body.include_usage:  # count the prompts here (too long ones refused by characters first), and
            # hand the engine the very ids counted: all in one worker thread when their texts together are long
            # (256 short prompts, one at a time on the loop, would hold it for their sum); those ids are the
            # serving version's, run by it or made again (a swap while they were made ran them on the new one)
            g.pin()
            for prompt in body.prompts:  # the engine's refusal, counted as generate's, before any is tokenized here
                g.engine.check_prompt_size(prompt, model=g.model)
            tokenizer = _engine.generator_tokenizer(g.engine, g.model)
            texts = sum(len(p) for p in prompts if isinstance(p, str))
            prompts = await self._off_loop_if_long(call.party, texts, lambda: [
                p if isinstance(p, list) or tokenizer is None else g.engine.tokenize(p, model=g.model)
                for p in body.prompts])
        streams = [g.engine.stream(p, g.params, request_id=rid, **g.args) for p, rid in zip(prompts, g.ids)]
        prompt_tokens = sum(len(p) for p in prompts if isinstance(p, list))
        return await self._stream(call, g.reply, streams, n, prompt_tokens, body.field)

    async def _stream(self, call: _Call, reply: Reply, streams: Sequence[AsyncIterator[StreamDelta]], n: int,
                      prompt_tokens: int, rename: Callable[[str], str]) -> Response:
        """Prime the streams (errors are still 4xx/5xx here), then answer 200 with their SSE events (an error
        after the 200 is an event, its ``param`` the body's field, ``rename``)."""
        merged = MergedStreams(streams)
        try:
            await unless_disconnected(call.request, merged.prime())
        except BaseException:
            merged.close()
            raise
        def close() -> None:
            try:
                merged.close()
            finally:
                call.give_back()
        return EventStream(self._events(merged, reply, call, n, len(streams), prompt_tokens, rename), close,
                           {"x-request-id": call.id})

    async def _events(self, merged: MergedStreams, reply: Reply, call: _Call, n: int, num_prompts: int,
                      prompt_tokens: int, rename: Callable[[str], str]) -> AsyncIterator[bytes]:
        completion_tokens = 0
        try:
            if reply.chat:
                yield reply.role_chunk(n * num_prompts)
            async for prompt_index, delta in merged:
                completion_tokens += len(delta.token_ids)
                if reply.want_logprobs and delta.logprobs:  # a tokenizer decode per token and alternative
                    yield await self.work_shares.run(call.party, reply.delta_chunk, prompt_index * n + delta.index,
                                                     delta.text, delta.logprobs, delta.finish_reason,
                                                     delta.token_ids)
                elif delta.text or delta.finish_reason is not None or (reply.token_ids and delta.token_ids):
                    args = (prompt_index * n + delta.index, delta.text, delta.logprobs, delta.finish_reason,
                            delta.token_ids)
                    if reply.tools is None:
                        yield reply.delta_chunk(*args)
                    else:  # read for calls: a delta may hold all that was generated while the client read slowly
                        # (the engine merges a sample's unread pieces), up to the context's length: read in a
                        # worker thread past the loop's share, as a whole answer's calls are
                        yield await self._off_loop_if_long(call.party, len(delta.text),
                                                            functools.partial(reply.delta_chunk, *args))
            if reply.include_usage:
                yield reply.usage_chunk(prompt_tokens, completion_tokens)
            yield SSE_DONE
        except _EXITS:
            raise
        except BaseException as exc:  # noqa: BLE001 - the 200 is gone: the error travels as an event, as OpenAI sends it
            yield sse(from_exception(exc, call.id, rename).body())

    async def _whole(self, call: _Call, reply: Reply, build: Callable[[], dict[str, Any]]) -> Response:
        """A whole answer, ``build()`` as JSON. With logprobs it costs a tokenizer decode per token and per
        alternative (seconds for a long answer with ``top_logprobs``), and with tools a read of every choice's reply
        for its calls (up to 64 choices of hundreds of calls: about a second): then it is built and encoded in one of
        the caller's worker threads, and the loop serves everyone else meanwhile."""
        if not reply.want_logprobs and reply.tools is None:
            return _json(build())
        body = await self.work_shares.run(call.party, lambda: msgspec.json.encode(build()))
        return Response(body, 200, media_type="application/json")

    # -------------------------------------------------------------- embeddings
    async def _embed(self, body: EmbeddingRequest, call: _Call) -> Response:
        engine = self.engine()
        model, _info = self._pick(body.model, "embed")
        dimension = _engine.embedding_dimension(engine, model)
        if body.dimensions is not None and body.dimensions != dimension:
            raise APIError(400, f"`dimensions` must be {dimension} for `{model}` (it cannot shorten its vectors).",
                           param="dimensions")
        tenant = self._embedding_tenant(call, body.user)
        count_tokens = _engine.embedding_token_counter(engine, model)  # before the await: the model may go meanwhile
        vectors = await unless_disconnected(call.request, engine.embed(body.texts, model=model, tenant=tenant))
        counts = await self._off_loop_if_long(call.party, texts_cost(body.texts), lambda: count_tokens(body.texts))
        rows = vectors.numpy()
        tokens = sum(counts)

        def answer() -> Response:
            data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(row.astype("<f4").tobytes())
                     .decode() if body.base64 else row.tolist()} for i, row in enumerate(rows)]
            return _json({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
        # 2048 vectors are millions of floats to write as JSON (tens of ms for a small model's, more for a wider
        # one): in a worker thread past the loop's share, as a long logprobs answer is
        return await self._off_loop_if_long(call.party, rows.size * _FLOAT_CHARS, answer)


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def _requests(n: int) -> str:
    """``1 request``, ``2 requests``."""
    return f"{n} request" if n == 1 else f"{n} requests"


def _tokens(outputs: Sequence[Any]) -> int:
    return sum(len(c.token_ids) for c in outputs)


def _check_json_type(content_type: str | None) -> None:
    """A 415 unless the body is declared ``application/json`` (any case, UTF-8 if a charset is named).
    A body without a ``Content-Type`` is read as JSON, as a client that sends none means it."""
    if content_type is None:
        return
    media, *params = (part.strip().lower() for part in content_type.split(";"))
    charsets = [p.partition("=")[2].strip().strip('"') for p in params if p.partition("=")[0].strip() == "charset"]
    if media == "application/json" and all(c in ("utf-8", "utf8") for c in charsets):
        return
    raise APIError(415, f"The request body must be JSON: send the header `Content-Type: application/json` (UTF-8; "
                        f"curl: -H 'Content-Type: application/json'), got Content-Type {content_type[:100]!r}.",
                   code="unsupported_media_type")


def _check_transfer_coding(values: list[str]) -> None:
    """A 501 naming the codings of a body sent in any transfer coding but ``chunked`` alone: httptools takes any list
    that ends in ``chunked`` (``gzip, chunked``) and hands on the chunks' bytes as they are, still in the others'
    coding (h11 refuses such a request as unparsable)."""
    codings = [c.strip().lower() for value in values for c in value.split(",")]
    if values and codings != ["chunked"]:
        shown = ", ".join(values)[:100]
        raise APIError(501, f"The request body must not be transfer-coded but for `chunked`: Transfer-Encoding {shown!r} "
                            "is not supported (send it as plain JSON).", code="unsupported_transfer_encoding",
                       headers=NO_RETRY)


def _group(tenant: str | None, key: str | None) -> str | None:
    """Whom a call is for, as the engine's ``tenant`` keywords take it (``generate``/``stream``: whose turns its
    grammar compile takes; ``embed``: whose turns its texts take in the batches): its tenant, else its API key, both
    named by a hash, in two spaces that cannot meet (``tenant:<sha256 of the name>``, ``key:<sha256 of the key>``;
    never the key itself): a tenant named ``key:<a key's hash>`` joined that key's group when names went as they
    were. None without either: the one group of all such calls."""
    if tenant is not None:
        return "tenant:" + hashlib.sha256(tenant.encode()).hexdigest()
    if key is None:
        return None
    return "key:" + hashlib.sha256(key.encode()).hexdigest()


def _escape_tenant(name: str) -> str:
    """``name`` with "%" and "/" escaped (``%25``, ``%2F``): one-to-one, and never a "/" inside."""
    return name.replace("%", "%25").replace("/", "%2F")
