"""Scheduler lookup: a built-in name, a class, a ``"pkg.module:Class"`` path, or an
entry point in the ``asyncinfer.schedulers`` group installed by another package.

A third-party package adds a name with, in its ``pyproject.toml``::

    [project.entry-points."asyncinfer.schedulers"]
    fair-share = "my_package.scheduling:FairShareScheduler"
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import InvalidParameterError, exception_text
from asyncinfer.schedulers.base import SCHEDULER_API_VERSION, Scheduler, SchedulerConfig
from asyncinfer.step import ENDS_ENGINE

ENTRY_POINT_GROUP = "asyncinfer.schedulers"

# Lazily imported factories: the name costs nothing until it is used.
_BUILTIN: dict[str, str] = {
    "fifo": "asyncinfer.schedulers.fifo:FIFOScheduler",
    "length-bucket": "asyncinfer.schedulers.length_bucket:LengthBucketScheduler",
    "aging-priority": "asyncinfer.schedulers.aging_priority:AgingPriorityScheduler",
    "pd-split": "asyncinfer.schedulers.pd_split:PDSplitScheduler",
}
_REGISTERED: dict[str, type[Scheduler]] = {}


#: The longest name :func:`register_scheduler` takes.
MAX_SCHEDULER_NAME = 200


def register_scheduler(name: str) -> Callable[[type[Scheduler]], type[Scheduler]]:
    """Class decorator that makes ``scheduler=name`` work in this process.

    Registering a name again (a module or notebook cell run twice) replaces its class.

    Raises:
        InvalidParameterError: ``name`` is not a non-empty string of at most :data:`MAX_SCHEDULER_NAME`
            characters, or is a built-in's (``"fifo"``, ...: it replaced that policy for every engine of the
            process, and an int broke :func:`available_schedulers`); the decorated object is not a
            :class:`Scheduler` subclass (it was refused only when an engine loaded it), or is one that leaves
            abstract methods undefined (``schedule``, or :class:`OrderedScheduler`'s ``lane_of``/``key_of``).
    """
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_SCHEDULER_NAME:
        raise InvalidParameterError("name", name, f"a non-empty string of at most {MAX_SCHEDULER_NAME} characters")
    if name in _BUILTIN:
        raise InvalidParameterError("name", name, f"a name that is not a built-in scheduler's ({list(_BUILTIN)})")

    def wrap(cls: type[Scheduler]) -> type[Scheduler]:
        if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
            raise InvalidParameterError(
                "scheduler", cls, f"a subclass of asyncinfer.schedulers.Scheduler (registering {name!r})")
        _refuse_abstract(cls, cls, f" (registering {name!r})")
        _REGISTERED[name] = cls
        return cls

    return wrap


def _refuse_abstract(cls: type[Scheduler], spec: object, suffix: str = "") -> None:
    """A class with abstract methods left undefined could not be built: refused as the ``scheduler``, naming the
    methods (it was refused only once the engine had read the weights, as ``scheduler_options={}``)."""
    missing = sorted(cls.__abstractmethods__)  # Scheduler is an ABC: every subclass has the set
    if missing:
        raise InvalidParameterError(
            "scheduler", spec, f"a Scheduler subclass that defines {', '.join(missing)} ({cls.__name__} leaves "
            f"{'it' if len(missing) == 1 else 'them'} abstract){suffix}")


def registered_schedulers() -> dict[str, type[Scheduler]]:
    """The names registered in this process with :func:`register_scheduler`, and their classes."""
    return dict(_REGISTERED)


def builtin_schedulers() -> list[str]:
    """The names that ship with asyncinfer, default first."""
    return list(_BUILTIN)


def available_schedulers() -> list[str]:
    """Every name ``scheduler=`` accepts here: built-in, registered, and installed entry points."""
    names = set(_BUILTIN) | set(_REGISTERED)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def _did_you_mean(spec: str, names: list[str]) -> str:
    """The hint for a scheduler name that is none of ``names``: the one it spells in another case or with ``_``
    for ``-`` (``"length_bucket"``, ``"FIFO"``), else the closest (``"pd-splt"``), else nothing."""
    import difflib

    normal = {name.lower().replace("_", "-"): name for name in names}
    typed = spec.strip().lower().replace("_", "-")
    near = normal.get(typed) or next(iter(difflib.get_close_matches(typed, sorted(normal), n=1, cutoff=0.75)), None)
    return f"; did you mean {normal.get(near, near)!r}?" if near else ""


def _import_path(path: str) -> object:
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _file_path(spec: str, module_name: str, attr: str) -> InvalidParameterError:
    """The refusal of a spec that names a file (``plugins/fair.py:Fair``): it read as ``No module named
    'plugins/fair'``; the dotted name it means is shown."""
    parts = [p for p in module_name.removesuffix(".py").replace("\\", "/").split("/") if p not in ("", ".")]
    where = parts[0] if len(parts) > 1 else "it"
    return InvalidParameterError("scheduler", spec, f"an importable 'module:Class': a module's dotted name, not a "
                                 f"file's path (here {'.'.join(parts)}:{attr}, run from the directory that holds {where})")


def _import_plugin(spec: str) -> object:
    """The class a ``'module:Class'`` spec names. A spec of no absolute module (``':X'``, ``'.rel:X'``) or no
    class, and a module that fails as it is imported (its own ``SyntaxError``, or whatever its top level
    raises), are the plugin's fault, refused as ``InvalidParameterError`` with the cause chained: they read
    as the engine's own failure before."""
    module_name, _, attr = spec.partition(":")
    if attr and ("/" in module_name or "\\" in module_name):  # a file's path, as a shell completes it
        raise _file_path(spec, module_name, attr)
    if not module_name or module_name.startswith(".") or not attr:
        raise InvalidParameterError("scheduler", spec, "an importable 'module:Class' (an absolute module and a class)")
    try:
        return _import_path(spec)
    except (ImportError, AttributeError) as exc:
        if isinstance(exc, ImportError) and module_name.endswith(".py"):  # "myplug.py:Class": no such package
            raise _file_path(spec, module_name, attr) from exc
        raise InvalidParameterError("scheduler", spec, f"an importable 'module:Class' ({exc})") from exc
    except ENDS_ENGINE:
        raise
    except BaseException as exc:  # the module's own code failed while it was imported (a class of
        # its own deriving from BaseException, or asyncio.CancelledError, too: it went through bare, a traceback)
        raise InvalidParameterError(
            "scheduler", spec,
            f"an importable 'module:Class' (importing {module_name!r} raised {exception_text(exc)})") from exc


def _load_entry_point(spec: str, entry_point: EntryPoint) -> object:
    """The object an installed package's entry point names; its failure to import is the package's fault."""
    try:
        return entry_point.load()
    except ENDS_ENGINE:
        raise
    except BaseException as exc:  # as _import_plugin
        raise InvalidParameterError(
            "scheduler", spec,
            f"an entry point that imports ({entry_point.value!r} raised {exception_text(exc)})") from exc


def resolve_scheduler(spec: str | type[Scheduler]) -> type[Scheduler]:
    """Turn a ``scheduler=`` option into a :class:`Scheduler` subclass.

    Raises:
        InvalidParameterError: unknown name, unimportable path, not a Scheduler
            subclass, one with abstract methods left undefined, or a plugin written for a newer contract than this engine's.
    """
    if isinstance(spec, type):
        cls: object = spec
    elif isinstance(spec, str) and spec in _REGISTERED:
        cls = _REGISTERED[spec]
    elif isinstance(spec, str) and spec in _BUILTIN:
        cls = _import_path(_BUILTIN[spec])
    elif isinstance(spec, str) and ":" in spec:
        cls = _import_plugin(spec)
    elif isinstance(spec, str):
        matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not matches:
            names = available_schedulers()
            raise InvalidParameterError("scheduler", spec, f"one of {names} or 'module:Class'{_did_you_mean(spec, names)}")
        cls = _load_entry_point(spec, matches[0])
    else:
        raise InvalidParameterError("scheduler", spec, "a name, a Scheduler subclass or 'module:Class'")
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise InvalidParameterError("scheduler", spec, "a subclass of asyncinfer.schedulers.Scheduler")
    _refuse_abstract(cls, spec)
    if cls.api_version > SCHEDULER_API_VERSION:
        raise InvalidParameterError(
            "scheduler", spec, f"a plugin for scheduler API <= {SCHEDULER_API_VERSION} (it needs {cls.api_version})"
        )
    return cls


def create_scheduler(
    spec: str | type[Scheduler],
    config: SchedulerConfig,
    kv: KVCacheManager,
    options: Mapping[str, Any] | None = None,
) -> Scheduler:
    """Build the scheduler ``spec`` names with its ``options`` (the engine's ``scheduler_options``).

    Raises:
        InvalidParameterError: as :func:`resolve_scheduler`, an option the class does not take, or a constructor
            that returned without calling ``Scheduler.__init__`` (the queues every hook reads were never made:
            the first request failed with ``AttributeError: ... no attribute 'requests'``, blamed on the model's
            load by the engine and on asyncinfer by the lab).
    """
    cls = check_scheduler_options(spec, options)
    scheduler = cls(config, kv, **dict(options or {}))
    missing = [name for name in _BASE_STATE if not hasattr(scheduler, name)]
    if missing:
        raise InvalidParameterError(
            "scheduler", spec, f"a class whose constructor calls super().__init__(config, kv) ({cls.__name__}'s "
            f"returned without it: no {', '.join(missing)})")
    return scheduler


# What Scheduler.__init__ sets, and every hook and helper of the base class reads.
_BASE_STATE = ("config", "kv", "waiting", "running", "requests")


def check_scheduler_options(spec: str | type[Scheduler], options: Mapping[str, Any] | None = None) -> type[Scheduler]:
    """The class ``spec`` names, once its ``options`` are known to be keywords it takes: checked
    before anything is loaded (the engine's load and memory plan call it first), so a bad
    ``scheduler`` or ``scheduler_options`` is refused at once, not after the weights are read.

    Raises:
        InvalidParameterError: as :func:`resolve_scheduler`, or an option the class does not take.
    """
    cls = resolve_scheduler(spec)
    options = dict(options or {})
    signature = inspect.signature(cls)
    try:
        signature.bind(None, None, **options)  # (config, kv, **options), as create_scheduler calls it
    except TypeError as exc:
        raise InvalidParameterError("scheduler_options", options,
                                    f"keywords {cls.__name__} accepts: {_keywords(signature)} ({exc})") from exc
    return cls


def _keywords(signature: inspect.Signature) -> str:
    """The options a scheduler's constructor takes by keyword, beyond ``(config, kv)``, for an error message."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]  # config, kv
    names = [p.name for p in params if p not in positional and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return ", ".join(names) or "none"
