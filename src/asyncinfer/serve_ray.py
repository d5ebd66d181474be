"""Scale-out on Ray Serve (``pip install 'asyncinfer[ray]'``): replicas, each one engine behind the OpenAI router.

One machine is one engine; beyond it, replicas. Each replica is a Ray actor
that loads its own :class:`~asyncinfer.AsyncEngine` (one copy of each model) and
serves :func:`~asyncinfer.server.create_app` as its ingress. Ray Serve's proxy
routes requests to the replicas and, with ``autoscaling_config``, adds and
removes replicas with the load. Every response names its replica in the
``X-Asyncinfer-Instance`` header.

    from ray import serve
    from asyncinfer.serve_ray import openai_app
    from asyncinfer.server import ModelSpec

    serve.run(openai_app(ModelSpec("/models/llama", "llama"), num_replicas=4), route_prefix="/")

A model swap is a ``user_config`` change, ``{"model": PATH, "options": {...}}``:
redeploying with a new one makes Ray call each replica's ``reconfigure``, a
bounded number of replicas at a time (``rolling_update_percentage``: one at a
time below ten replicas), and each replica swaps with
:meth:`~asyncinfer.AsyncEngine.swap_model`, serving the old version until the
new one is loaded. See docs/scale_out.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from asyncinfer.config import EngineConfig
from asyncinfer.embedding import EmbeddingConfig
from asyncinfer.errors import InvalidParameterError
from asyncinfer.server import ModelSpec, ServerSettings, create_app
from asyncinfer.server.settings import keys_from_text, model_specs

__all__ = ["OpenAIReplica", "build", "openai_app"]

log = logging.getLogger("ray.serve")  # Ray Serve writes this logger to the replica's log


@serve.ingress()
class OpenAIReplica:
    """One replica: one engine with ``models`` loaded, serving the OpenAI routes."""

    async def __init__(self, models: ModelSpec | Sequence[ModelSpec], settings: ServerSettings | None = None) -> None:
        # Ray's wrapper class owns ``app`` and friends: these names stay clear of it.
        self._specs = model_specs(models)
        replica = serve.get_replica_context().replica_id.unique_id
        self._server = create_app(self._specs, dataclasses.replace(settings or ServerSettings(), instance_id=replica))
        self._loaded = self._specs[0].model

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._server

    async def reconfigure(self, config: Mapping[str, Any]) -> None:
        """Swap the first model to ``config["model"]`` (with ``config["options"]``) unless it is loaded already."""
        model = config.get("model")
        if model is None or model == self._loaded:
            return
        await self._server.state.engine.swap_model(model, name=self._specs[0].name, **dict(config.get("options") or {}))
        log.info("swapped %s from %s to %s", self._specs[0].name, self._loaded, model)
        self._loaded = model


def openai_app(
    models: ModelSpec | Sequence[ModelSpec],
    settings: ServerSettings | None = None,
    *,
    name: str = "asyncinfer",
    num_replicas: int | str | None = 1,
    autoscaling_config: Mapping[str, Any] | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    max_ongoing_requests: int = 64,
    user_config: Mapping[str, Any] | None = None,
) -> Application:
    """A Ray Serve application of OpenAI-compatible replicas, for ``serve.run(...)``.

    ``models`` and ``settings`` are what :func:`~asyncinfer.server.create_app` takes
    (every replica loads them). ``num_replicas`` is a fixed count, or ``"auto"``
    / ``None`` with ``autoscaling_config`` (Ray Serve's: ``min_replicas``,
    ``max_replicas``, ``target_ongoing_requests``, ...). ``ray_actor_options``
    sizes each replica (``num_cpus``, ``num_gpus``, ``memory``).
    ``max_ongoing_requests`` caps the requests Ray hands one replica at once; the
    engine batches them. ``user_config``: ``{"model": ..., "options": {...}}``
    swaps the first model on every replica, rolling (see the module docstring).
    """
    options: dict[str, Any] = {"name": name, "max_ongoing_requests": max_ongoing_requests}
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    if num_replicas is not None and autoscaling_config is None:
        options["num_replicas"] = num_replicas
    if ray_actor_options is not None:
        options["ray_actor_options"] = dict(ray_actor_options)
    specs = model_specs(models)
    if user_config is not None:
        options["user_config"] = dict(user_config)
        if user_config.get("model") is not None:  # new replicas load it at once; reconfigure has nothing to do
            first = specs[0]
            options_now = {**first.options, **dict(user_config.get("options") or {})}
            specs = (ModelSpec(user_config["model"], first.name, options_now), *specs[1:])
    return serve.deployment(OpenAIReplica, **options).bind(specs, settings)


def build(args: Mapping[str, Any]) -> Application:
    """The application builder for Ray Serve's config files and ``serve run``:

        serve run asyncinfer.serve_ray:build model=/models/llama name=llama num_replicas=2

    ``args``: ``model``, ``name`` (default: the model's file name), ``options`` (engine
    options), ``embedding_model``, ``num_replicas``, ``autoscaling_config``,
    ``ray_actor_options``, ``max_ongoing_requests``, ``api_keys`` (a list of keys, as a config file's YAML
    list gives it, or text of comma-separated keys, as ``serve run ... api_keys=sk-one,sk-two`` gives it),
    ``cache_isolation``.
    Deployed from a config file, a later change of the deployment's ``user_config``
    alone (``{"model": ...}``) reconfigures the running replicas in place, rolling:
    each swaps its model hot (:meth:`~asyncinfer.AsyncEngine.swap_model`).
    """
    _check_build_args(args)
    model = args.get("model")
    specs = [ModelSpec(model, args.get("name") or ModelSpec.served_name(model), dict(args.get("options") or {}))]
    if args.get("embedding_model"):
        specs.append(ModelSpec(args["embedding_model"], ModelSpec.served_name(args["embedding_model"])))
    settings = _server_settings(args)
    kwargs = {key: args[key] for key in ("num_replicas", "autoscaling_config", "ray_actor_options",
                                          "max_ongoing_requests") if key in args}
    for key in ("num_replicas", "max_ongoing_requests"):  # serve run gives text; checked above
        if isinstance(kwargs.get(key), str) and kwargs[key].isdigit():
            kwargs[key] = int(kwargs[key])
    return openai_app(specs, settings, **kwargs)


#: The arguments :func:`build` takes (``serve run asyncinfer.serve_ray:build KEY=VALUE ...``, or a config file's ``args``).
BUILD_ARGS = ("model", "name", "options", "embedding_model", "num_replicas", "autoscaling_config", "ray_actor_options",
              "max_ongoing_requests", "api_keys", "cache_isolation")


def _check_build_args(args: Mapping[str, Any]) -> None:
    """Refuse, before anything is deployed, what :func:`build` would otherwise drop or hand on to fail elsewhere: an
    argument it does not take (a typo such as ``num_replica=2`` served one replica), a mapping argument given as
    text (Python's ``dictionary update sequence element`` error), an engine option of an unknown name in
    ``options`` (it failed in every replica, in Ray's tracebacks), and a replica count that is not a count. Option
    values are checked where the engine loads (a GPU option is valid on a replica's node, not on this one)."""
    if not isinstance(args, Mapping):
        raise InvalidParameterError("args", args, f"a mapping of build's arguments: {list(BUILD_ARGS)}")
    for key, value in args.items():
        if key not in BUILD_ARGS:
            raise InvalidParameterError(key, value, f"an argument of asyncinfer.serve_ray:build: {list(BUILD_ARGS)} "
                                        "(engine options go in options, a mapping)")
    for key in ("model", "name", "embedding_model"):  # `embedding_model: 5` in YAML raised a bare AttributeError
        value = args.get(key)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise InvalidParameterError(key, value, "the name the model is served as (text)" if key == "name"
                                        else "a model path or a known name (text)")
    for key in ("options", "autoscaling_config", "ray_actor_options"):
        value = args.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise InvalidParameterError(key, value, "a mapping, as a config file's YAML gives it (serve run's "
                                        "KEY=VALUE arguments give text: use a config file for it)")
    known = {field.name for config in (EngineConfig, EmbeddingConfig) for field in dataclasses.fields(config)}
    for key, value in (args.get("options") or {}).items():
        if key not in known:
            raise InvalidParameterError(f"options.{key}", value, f"a known engine option (a generator's or an embedding model's): {sorted(known)}")
    for key in ("num_replicas", "max_ongoing_requests"):
        value = args.get(key)
        if value is None or (key == "num_replicas" and value == "auto"):
            continue
        if isinstance(value, str) and value.isascii() and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            allowed = "an integer >= 1 (or its digits as text)" + (", or 'auto' with autoscaling_config"
                                                                   if key == "num_replicas" else "")
            raise InvalidParameterError(key, args[key], allowed)


def _server_settings(args: Mapping[str, Any]) -> ServerSettings:
    """The :class:`ServerSettings` of :func:`build`'s ``args``: ``api_keys`` and ``cache_isolation``."""
    return ServerSettings(api_keys=_api_keys(args.get("api_keys")), cache_isolation=args.get("cache_isolation", "off"))


def _api_keys(value: Any) -> tuple[str, ...]:
    """``api_keys`` as :func:`build` takes it: absent (``None``): no key; text: keys separated by commas (``serve
    run`` gives every argument as text; it was read a character at a time, each character a key), blank or with an
    empty item refused; a list (or another sequence) of keys, checked by :class:`ServerSettings`."""
    if value is None:
        return ()
    if isinstance(value, str):
        return keys_from_text("api_keys", value, "leave api_keys out to ask for none")
    if not isinstance(value, Sequence):
        raise InvalidParameterError("api_keys", value, "a list of keys, or text of comma-separated keys")
    return tuple(value)
