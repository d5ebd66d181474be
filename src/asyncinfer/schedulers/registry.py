"""Scheduler lookup: a built-in name, a class, a ``"pkg.module:Class"`` path, or an
entry point in the ``asyncinfer.schedulers`` group installed by another package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.schedulers.base import Scheduler, SchedulerConfig

ENTRY_POINT_GROUP = "asyncinfer.schedulers"

# Lazily imported factories: the name costs nothing until it is used.
_BUILTIN: dict[str, str] = {
    "fifo": "asyncinfer.schedulers.fifo:FIFOScheduler",
}
_REGISTERED: dict[str, type[Scheduler]] = {}


def register_scheduler(name: str) -> Callable[[type[Scheduler]], type[Scheduler]]:
    """Class decorator that makes ``scheduler=name`` work in this process."""

    def wrap(cls: type[Scheduler]) -> type[Scheduler]:
        _REGISTERED[name] = cls
        return cls

    return wrap


def available_schedulers() -> list[str]:
    names = set(_BUILTIN) | set(_REGISTERED)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def _import_path(path: str) -> object:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve_scheduler(spec: str | type[Scheduler]) -> type[Scheduler]:
    """Turn a ``scheduler=`` option into a :class:`Scheduler` subclass."""
    if isinstance(spec, type):
        cls: object = spec
    elif isinstance(spec, str) and spec in _REGISTERED:
        cls = _REGISTERED[spec]
    elif isinstance(spec, str) and spec in _BUILTIN:
        cls = _import_path(_BUILTIN[spec])
    elif isinstance(spec, str) and ":" in spec:
        try:
            cls = _import_path(spec)
        except (ImportError, AttributeError) as exc:
            raise InvalidParameterError("scheduler", spec, f"an importable 'module:Class' ({exc})") from exc
    elif isinstance(spec, str):
        matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not matches:
            raise InvalidParameterError("scheduler", spec, f"one of {available_schedulers()} or 'module:Class'")
        cls = matches[0].load()
    else:
        raise InvalidParameterError("scheduler", spec, "a name, a Scheduler subclass or 'module:Class'")
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise InvalidParameterError("scheduler", spec, "a subclass of asyncinfer.schedulers.Scheduler")
    return cls


def create_scheduler(spec: str | type[Scheduler], config: SchedulerConfig, kv: KVCacheManager) -> Scheduler:
    return resolve_scheduler(spec)(config, kv)
