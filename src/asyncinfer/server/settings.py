"""What the HTTP layer is told: who may call it and as whom, how much it reads, which models it loads."""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.catalog import check_name
from asyncinfer.errors import InvalidParameterError
from asyncinfer.prompts import MAX_TENANT_CHARS  # a tenant's name (and the OpenAI ``user``): heads the request ids

#: Environment variable with the accepted API keys, comma-separated (``--api-key`` adds to them).
API_KEYS_ENV = "ASYNCINFER_API_KEY"
#: Environment variable with the keys that may read ``/metrics``, comma-separated (``--metrics-key`` adds to them).
METRICS_KEYS_ENV = "ASYNCINFER_METRICS_KEY"

CACHE_ISOLATION = ("off", "api-key", "header")
TENANT_FROM = ("api-key", "header", "request")
MAX_INSTANCE_ID_CHARS = 256  # ServerSettings.instance_id, a header's value
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110's token: what a field name may hold


def keys_from_text(name: str, raw: str, unset: str = "unset it to ask for none") -> tuple[str, ...]:
    """The keys in ``raw``, comma-separated, spaces around each dropped. Blank (``""``, spaces, commas only), or
    with an empty item (``sk-x,,sk-y``, a trailing comma): ``InvalidParameterError`` naming ``name`` (``unset``
    says how to ask for no key instead), so that a server meant to ask for keys never starts without them; so is
    a key holding a character that is not printable ASCII, which no client can send (never shown)."""
    keys = tuple(key.strip() for key in raw.split(","))
    if not all(keys):  # set to nothing, or with a blank item ("sk-x,,sk-y"): not what someone meant to require
        shown = raw if not any(keys) else "<keys with an empty item between commas>"
        raise InvalidParameterError(name, shown, "comma-separated non-empty keys, no empty item between or "
                                                 f"after the commas ({unset})")
    _check_sendable(name, keys)  # named here: refused later, as api_keys, it read as a key given by a flag or in code
    return keys


def _keys_from_env(name: str, environ: Mapping[str, str] | None) -> tuple[str, ...]:
    raw = (os.environ if environ is None else environ).get(name)
    return () if raw is None else keys_from_text(name, raw)


def api_keys_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys in ``ASYNCINFER_API_KEY`` (comma-separated, spaces around each dropped).

    Unset: no key. Set but blank (``""``, spaces, commas only), or with an empty item
    (``sk-x,,sk-y``, a trailing comma), or with a key holding a character that is not printable ASCII:
    ``InvalidParameterError`` naming the variable, so a server meant to ask for keys never starts
    without the keys someone meant.
    """
    return _keys_from_env(API_KEYS_ENV, environ)


def metrics_keys_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys in ``ASYNCINFER_METRICS_KEY``, read as :func:`api_keys_from_env` reads its variable."""
    return _keys_from_env(METRICS_KEYS_ENV, environ)


#: How a ``tenant_from`` refusal names ``tenants`` (``asyncinfer serve`` says it in its flag's words).
TENANTS_GIVEN = "tenants give keys a Tenant"

#: What a tenant name may be (the body's ``user`` with ``tenant_from="request"``, a proxy's tenant header, a key's
#: :class:`Tenant`): it heads engine request ids, which schedulers read and log lines show.
TENANT_NAME_ALLOWED = (f"a string of 1 to {MAX_TENANT_CHARS} printable characters (no control characters or line "
                       "breaks)")


def check_tenant_name(name: Any, parameter: str) -> str:
    """A tenant name: 1 to :data:`MAX_TENANT_CHARS` printable characters. A line break or another control
    character heads the request's id into the logs: a caller whose ``user`` field held
    ``"\nINFO ... request finished id=alice/..."`` wrote a line of its own, posing as another tenant's request."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENANT_CHARS or not name.isprintable():
        shown = name if not isinstance(name, str) or len(name) <= 64 else f"<{len(name)} chars>"
        raise InvalidParameterError(parameter, shown, TENANT_NAME_ALLOWED)
    return name


@dataclass(frozen=True)
class Tenant:
    """Who the requests made with one API key are, to the engine: ``ServerSettings(tenants={key: Tenant(...)})``.

    ``name`` heads the engine request ids of the key's requests (``<name>/<call id>``, the
    convention per-tenant schedulers read); ``priority`` is their engine priority (lower runs
    first with ``scheduler="aging-priority"``).
    """

    name: str
    priority: int = 0

    def __post_init__(self) -> None:
        check_tenant_name(self.name, "name")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidParameterError("priority", self.priority, "an int")


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise InvalidParameterError(name, value, "a finite number of seconds > 0")
    return float(value)


@dataclass(frozen=True)
class ServerSettings:
    """Options of :func:`~asyncinfer.server.openai_router`, :func:`~asyncinfer.server.create_app` and
    :func:`~asyncinfer.server.run_server` (docs/serving.md, "Who may get in" and "Limits").

    Keys:

    - ``api_keys``: accepted bearer keys; with none (and no ``tenants``) no key is asked for.
      Every ``/v1`` route checks it (OpenAI's 401 body otherwise), and under ``/v1`` an unknown
      URL or a wrong method is a 401 before its 404/405 (:func:`~asyncinfer.server.guard_app`);
      ``/health`` is open.
    - ``tenants``: more accepted keys, each with the :class:`Tenant` its requests run as.
    - ``metrics_keys``: the keys that may read ``/metrics`` (an operator's, never a tenant's:
      none may also be an API key). With them, ``/metrics`` asks for one of them; without
      them, ``/metrics`` is open on a server without API keys and refused (403) on one with.

    Identity (who a request is to the scheduler, and its priority), from the deployment,
    never from the caller unless ``tenant_from="request"`` says so:

    - ``tenant_from``: ``"api-key"`` (default): the caller's key's :class:`Tenant` (none for
      keys without one). ``"header"``: the value of ``tenant_header``, set by a proxy you
      trust. ``"request"``: the body's OpenAI ``user`` field, and its ``priority`` field
      wins (trusted callers only). Otherwise a body ``priority`` is refused (400) and ``user``
      is accepted and changes nothing.
    - ``tenant_priorities``: the engine priority of each tenant name (``"header"`` and
      ``"request"``; a key's :class:`Tenant` carries its own).
    - ``priority_header``: a header, set by a proxy you trust, whose integer value is the
      request's priority (over the tenant's); ``None`` (default): no header is read.

    Prefix cache:

    - ``cache_isolation``: who may share cached prompt prefixes. ``"off"``: everyone (the
      engine's default). ``"api-key"``: only requests made with the same key. ``"header"``:
      only requests with the same ``tenant_header`` value (set it in a proxy you trust;
      requests without it share one pool). Shared prefix caching lets one caller measure,
      by time to first token, whether another sent a prompt; isolation closes that.
    - ``tenant_header``: the header read by ``cache_isolation="header"`` and ``tenant_from="header"``. It and
      ``priority_header`` are header names a request can carry (RFC 9110 tokens, not ``authorization``); another
      is an :class:`~asyncinfer.errors.InvalidParameterError`.

    Limits (a slow or greedy client cannot hold the server):

    - ``max_body_bytes``: request bodies over this get a 413 before they are parsed.
    - ``header_timeout``: seconds a connection has to send a request's headers in full, from
      its opening or from the end of its previous answer (408 and closed otherwise).
    - ``body_timeout``: seconds a request has to send its body in full once its headers are in
      (408 and closed otherwise).
    - ``send_timeout``: seconds an answer may wait for the client to read it: when the connection's send
      buffer stays full (the client reads nothing) that long, the connection is closed, and a stream's
      requests are aborted as on a disconnect.
    - ``max_connections``: open connections at most; one more is answered 503 and closed.
      ``header_timeout``, ``send_timeout`` and ``max_connections`` act in :func:`~asyncinfer.server.run_server`
      (``asyncinfer serve``), the others in every app :func:`~asyncinfer.server.create_app`
      or :func:`~asyncinfer.server.guard_app` prepares.

    - ``max_requests_per_tenant``: generation requests (prompts of chat and completions calls, each of their
      ``n`` samples counted: every sample holds a seat of ``max_num_seqs``) one tenant may have in flight; past
      it a call is a 429, so that no tenant takes every place of the engine's admission control
      (``max_num_seqs + max_waiting_requests``). The tenant is the one ``tenant_from`` names; a call without one
      counts as its API key's, and calls with neither share one count. ``None`` (default): no limit.

    - ``instance_id``: sent back in the ``X-Asyncinfer-Instance`` header of every response
      (the Ray Serve helper sets it to the replica's id).
    """

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    cache_isolation: str = "off"
    tenant_header: str = "x-tenant-id"
    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    tenant_from: str = "api-key"
    tenant_priorities: Mapping[str, int] = field(default_factory=dict)
    priority_header: str | None = None
    metrics_keys: tuple[str, ...] = ()
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    send_timeout: float = 30.0
    max_connections: int = 512
    max_requests_per_tenant: int | None = None
    instance_id: str | None = None
    #: Deprecated name of ``tenant_priorities`` (it keyed priorities by the client's own ``user`` field);
    #: merged into ``tenant_priorities`` with a DeprecationWarning. Tenants now come from ``tenant_from``.
    user_priorities: Mapping[str, int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.user_priorities is not None:
            warnings.warn("ServerSettings(user_priorities=...) is deprecated: use tenant_priorities (keyed by the "
                          "tenant that tenant_from names; a client's own 'user' field names it only with "
                          "tenant_from='request')", DeprecationWarning, stacklevel=3)
            if not isinstance(self.user_priorities, Mapping):
                raise InvalidParameterError("user_priorities", self.user_priorities,
                                            "a mapping of tenant names to int priorities")
            object.__setattr__(self, "tenant_priorities", {**self.user_priorities, **self.tenant_priorities})
            object.__setattr__(self, "user_priorities", None)
        object.__setattr__(self, "api_keys", _key_tuple("api_keys", self.api_keys))
        object.__setattr__(self, "metrics_keys", _key_tuple("metrics_keys", self.metrics_keys))
        tenants = self.tenants
        if not isinstance(tenants, Mapping) or not all(
            isinstance(k, str) and k and isinstance(t, Tenant) for k, t in tenants.items()
        ):
            raise InvalidParameterError("tenants", tenants, "a mapping of non-empty API keys to Tenant(name, priority)")
        _key_tuple("tenants", tuple(tenants))  # as api_keys: a key with spaces around it never matches a bearer token
        shared = set(self.metrics_keys) & (set(self.api_keys) | set(tenants))
        if shared:
            raise InvalidParameterError("metrics_keys", "<a key also in api_keys or tenants>",
                                        "keys that are not also API keys (a tenant's key must not read /metrics)")
        size = self.max_body_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1024:
            raise InvalidParameterError("max_body_bytes", size, "an int >= 1024")
        if self.cache_isolation not in CACHE_ISOLATION:
            raise InvalidParameterError("cache_isolation", self.cache_isolation, f"one of {CACHE_ISOLATION}")
        if self.cache_isolation == "api-key" and not self.accepted_keys:
            raise InvalidParameterError("cache_isolation", "api-key", "'off' or 'header' when no api_keys are set")
        if self.tenant_from not in TENANT_FROM:
            raise InvalidParameterError("tenant_from", self.tenant_from, f"one of {TENANT_FROM}")
        if tenants and self.tenant_from != "api-key":  # a key's Tenant would be accepted, then never read
            raise InvalidParameterError(
                "tenant_from", self.tenant_from,
                f"'api-key' when {TENANTS_GIVEN} (with 'header' or 'request' the tenant and priority come from the "
                "header or the body, and a key's Tenant would go unused: give those keys as plain API keys, the "
                "priorities of tenant names as tenant_priorities)")
        object.__setattr__(self, "tenant_header", _header("tenant_header", self.tenant_header))
        if self.priority_header is not None:
            object.__setattr__(self, "priority_header", _header("priority_header", self.priority_header))
        prios = self.tenant_priorities
        if not isinstance(prios, Mapping) or not all(
            isinstance(u, str) and isinstance(p, int) and not isinstance(p, bool) for u, p in prios.items()
        ):
            raise InvalidParameterError("tenant_priorities", prios, "a mapping of tenant names to int priorities")
        object.__setattr__(self, "header_timeout", _seconds("header_timeout", self.header_timeout))
        object.__setattr__(self, "body_timeout", _seconds("body_timeout", self.body_timeout))
        object.__setattr__(self, "send_timeout", _seconds("send_timeout", self.send_timeout))
        cap = self.max_connections
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise InvalidParameterError("max_connections", cap, "an int >= 1")
        share = self.max_requests_per_tenant
        if share is not None and (isinstance(share, bool) or not isinstance(share, int) or share < 1):
            raise InvalidParameterError("max_requests_per_tenant", share, "None or an int >= 1")
        instance = self.instance_id
        if instance is not None and not (isinstance(instance, str) and 0 < len(instance) <= MAX_INSTANCE_ID_CHARS
                                         and instance.isascii() and instance.isprintable()
                                         and instance == instance.strip()):
            # a header value: one of another alphabet, or holding a line break, failed every answer of the server
            raise InvalidParameterError("instance_id", instance if not isinstance(instance, str) or len(instance) <= 64
                                        else f"<{len(instance)} chars>",
                                        f"None or 1 to {MAX_INSTANCE_ID_CHARS} printable ASCII characters, without "
                                        "spaces around them (it is sent as a header)")

    @property
    def accepted_keys(self) -> tuple[str, ...]:
        """Every key a ``/v1`` route accepts: ``api_keys`` and the keys of ``tenants``."""
        return (*self.api_keys, *(k for k in self.tenants if k not in self.api_keys))


def _header(name: str, header: Any) -> str:
    # An HTTP field name is a token (RFC 9110): one with a space, a ':' ("X-Tenant-Id:", as a curl -H line writes
    # it) or a letter of another alphabet is never in a request, so every request read as having no tenant or
    # priority, and cache_isolation="header" put every caller in one shared namespace.
    if (not isinstance(header, str) or not HEADER_NAME.fullmatch(header.strip())
            or header.strip().lower() == "authorization"):
        raise InvalidParameterError(name, header, "a header name other than authorization: ASCII letters, digits "
                                                  "and !#$%&'*+-.^_`|~, without ':' or spaces (e.g. x-tenant-id)")
    return header.strip().lower()


def _key_tuple(name: str, keys: Any) -> tuple[str, ...]:
    if isinstance(keys, str) or not isinstance(keys, Sequence) or not all(isinstance(k, str) and k for k in keys):
        raise InvalidParameterError(name, keys, "a sequence of non-empty strings")
    if any(k != k.strip() for k in keys):
        raise InvalidParameterError(name, "<a key with spaces around it>", "keys without leading or trailing spaces")
    _check_sendable(name, keys)
    return tuple(keys)


def _check_sendable(name: str, keys: Sequence[str]) -> None:
    if not all(k.isascii() and k.isprintable() for k in keys):
        # A client sends a header in ASCII (the openai package's httpx refuses anything else; curl sends UTF-8,
        # which the server reads as Latin-1): such a key ("sk\u2011..." with a non-breaking hyphen pasted from a
        # page, a line break) matched no request, and every call was a 401 "Incorrect API key provided".
        raise InvalidParameterError(name, "<a key with a character that is not printable ASCII>",
                                    "keys of printable ASCII characters (a client sends them in an Authorization "
                                    "header, which no other character reaches the server in)")


@dataclass(frozen=True)
class ModelSpec:
    """A model for :func:`~asyncinfer.server.create_app` to load: what ``from_pretrained`` /
    ``add_model`` take. The first spec starts the engine; the others are added to it."""

    model: str | None = None
    name: str = "default"
    options: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def served_name(model: str | None) -> str:
        """The name a model is served under when none is given: its file or directory name; a Hugging Face Hub id
        (read from the local Hugging Face cache) its whole id, as vLLM serves it and its clients ask for it. None (the
        default model) is SmolLM2-135M-Instruct, or where ``ASYNCINFER_MODEL`` names another model, that one's name."""
        from asyncinfer.model_source import DEFAULT_GGUF_NAME, is_hub_id, known_name

        if model is None:
            env = os.environ.get("ASYNCINFER_MODEL", "").strip()
            if env and os.path.basename(os.path.normpath(os.path.expanduser(env))) != DEFAULT_GGUF_NAME:
                return ModelSpec.served_name(os.path.expanduser(env))  # the model loaded, not SmolLM2's name
            return "SmolLM2-135M-Instruct"

        if is_hub_id(model) and not known_name(model) and not os.path.exists(model):
            return model
        # the directory's own name for `.`, `..` or `models/..` (`serve .` in a model's directory served it as ".")
        base = os.path.basename(os.path.abspath(os.path.expanduser(model)))
        if base.lower().endswith(".gguf"):  # MODEL.GGUF too, which loads as a GGUF file
            base = base[: -len(".gguf")]
        return base or model


def model_specs(models: ModelSpec | Sequence[ModelSpec]) -> tuple[ModelSpec, ...]:
    if not isinstance(models, (ModelSpec, Sequence)):  # tuple(5) was Python's "'int' object is not iterable"
        raise InvalidParameterError("models", models, "an AsyncEngine, a ModelSpec or a non-empty list of ModelSpecs")
    specs = (models,) if isinstance(models, ModelSpec) else tuple(models)
    if not specs or not all(isinstance(s, ModelSpec) for s in specs):
        raise InvalidParameterError("models", models, "an AsyncEngine, a ModelSpec or a non-empty list of ModelSpecs")
    for i, spec in enumerate(specs):  # refused here, not when the app starts (after the first model has loaded)
        try:
            check_name(spec.name)
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"models[{i}].name", exc.value, exc.allowed) from None
    names = [spec.name for spec in specs]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise InvalidParameterError("models", twice, "ModelSpecs of distinct names (a request names its model by it)")
    return specs
