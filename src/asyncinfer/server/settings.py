"""What the HTTP layer is told: who may call it, how much it reads, which models it loads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.errors import InvalidParameterError

#: Environment variable with the accepted API keys, comma-separated (``--api-key`` adds to them).
API_KEYS_ENV = "ASYNCINFER_API_KEY"

CACHE_ISOLATION = ("off", "api-key", "header")


def api_keys_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys in ``ASYNCINFER_API_KEY`` (comma-separated; blanks dropped)."""
    raw = (os.environ if environ is None else environ).get(API_KEYS_ENV, "")
    return tuple(key.strip() for key in raw.split(",") if key.strip())


@dataclass(frozen=True)
class ServerSettings:
    """Options of :func:`~asyncinfer.server.openai_router` and :func:`~asyncinfer.server.create_app`.

    - ``api_keys``: accepted bearer keys; empty means no key is asked for. Every ``/v1``
      route and ``/metrics`` check it (OpenAI's 401 body otherwise); ``/health`` is open.
    - ``max_body_bytes``: request bodies over this get a 413 before they are parsed.
    - ``cache_isolation``: who may share cached prompt prefixes. ``"off"``: everyone (the
      engine's default). ``"api-key"``: only requests made with the same key. ``"header"``:
      only requests with the same ``tenant_header`` value (set it in a proxy you trust;
      requests without it share one pool). Shared prefix caching lets one caller measure,
      by time to first token, whether another sent a prompt; isolation closes that.
    - ``tenant_header``: the header read by ``cache_isolation="header"``.
    - ``user_priorities``: the engine priority of requests whose OpenAI ``user`` field is a
      key here (lower runs first with ``scheduler="aging-priority"``); a request's own
      ``priority`` field wins.
    - ``instance_id``: sent back in the ``X-Asyncinfer-Instance`` header of every response
      (the Ray Serve helper sets it to the replica's id).
    """

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    cache_isolation: str = "off"
    tenant_header: str = "x-tenant-id"
    user_priorities: Mapping[str, int] = field(default_factory=dict)
    instance_id: str | None = None

    def __post_init__(self) -> None:
        keys = self.api_keys
        if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
            raise InvalidParameterError("api_keys", keys, "a sequence of non-empty strings")
        object.__setattr__(self, "api_keys", tuple(keys))
        size = self.max_body_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1024:
            raise InvalidParameterError("max_body_bytes", size, "an int >= 1024")
        if self.cache_isolation not in CACHE_ISOLATION:
            raise InvalidParameterError("cache_isolation", self.cache_isolation, f"one of {CACHE_ISOLATION}")
        if self.cache_isolation == "api-key" and not self.api_keys:
            raise InvalidParameterError("cache_isolation", "api-key", "'off' or 'header' when no api_keys are set")
        if not isinstance(self.tenant_header, str) or not self.tenant_header:
            raise InvalidParameterError("tenant_header", self.tenant_header, "a header name")
        object.__setattr__(self, "tenant_header", self.tenant_header.lower())
        prios = self.user_priorities
        if not isinstance(prios, Mapping) or not all(
            isinstance(u, str) and isinstance(p, int) and not isinstance(p, bool) for u, p in prios.items()
        ):
            raise InvalidParameterError("user_priorities", prios, "a mapping of user names to int priorities")


@dataclass(frozen=True)
class ModelSpec:
    """A model for :func:`~asyncinfer.server.create_app` to load: what ``from_pretrained`` /
    ``add_model`` take. The first spec starts the engine; the others are added to it."""

    model: str | None = None
    name: str = "default"
    options: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def served_name(model: str | None) -> str:
        """The name a model is served under when none is given: its file or directory name."""
        if model is None:
            return "SmolLM2-135M-Instruct"
        base = os.path.basename(os.path.normpath(model))
        return base.removesuffix(".gguf") or model


def model_specs(models: ModelSpec | Sequence[ModelSpec]) -> tuple[ModelSpec, ...]:
    specs = (models,) if isinstance(models, ModelSpec) else tuple(models)
    if not specs or not all(isinstance(s, ModelSpec) for s in specs):
        raise InvalidParameterError("models", models, "an AsyncEngine, a ModelSpec or a non-empty list of ModelSpecs")
    return specs
