"""Model changes on a live engine: swap a generator, add or remove a named model.

Loop side. Loading runs in worker threads (``loading.py``); the engine thread
learns of a change through typed commands, at a step boundary. One change at a
time (a lock), and every change either completes or leaves the serving models
as they were (a drain-mode swap whose new version fails loads the old one again).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import torch

from asyncinfer.catalog import EmbeddingModel, ModelCatalog, current, version_info
from asyncinfer.config import EngineConfig
from asyncinfer.embedding import EmbeddingBatcher, EmbeddingConfig
from asyncinfer.engine_thread import AbortEmbeds, AddHolder, DrainVersion, RemoveHolder, SwitchVersion, ThreadLink
from asyncinfer.errors import (
    ConfigurationError,
    EngineClosedError,
    EngineDeadError,
    InvalidParameterError,
    ModelLoadError,
    SwapError,
)
from asyncinfer.holder import ModelHolder, ModelVersion, ModelVersionInfo
from asyncinfer.loading import (
    ModelRef,
    embedder_shortfall_at,
    generator_shortfall,
    load,
)
from asyncinfer.memory import MemoryPlan, check_available_bytes
from asyncinfer.model_source import model_text, resolve_model
from asyncinfer.models.encoder import is_encoder_dir
from asyncinfer.plain import logged, plain_value

T = TypeVar("T")

#: One INFO line per model change that took effect, one WARNING per swap or add that failed to load (none for a
#: call refused before anything was read): docs/monitoring/README.md, "Logging".
logger = logging.getLogger("asyncinfer.models")


class ChangeObserver(Protocol):
    """What :class:`ModelChanges` tells (``asyncinfer.metrics.EngineMetrics`` listens)."""

    def watch(self, name: str, version: ModelVersion) -> None: ...

    def count_swap(self, name: str | None, outcome: str) -> None: ...


class ModelChanges:
    """``swap_model``, ``add_model`` and ``remove_model`` of one engine (see ``AsyncEngine``'s docstrings)."""

    def __init__(
        self,
        models: ModelCatalog,
        link: ThreadLink,
        version_ids: Iterator[int],
        check_usable: Callable[[], None],
        device: torch.device,
        observer: ChangeObserver | None = None,
    ) -> None:
        self.models = models
        self.link = link
        self.version_ids = version_ids
        self.check_usable = check_usable  # raises unless the engine is created or running
        self.device = device
        # Told of every new generator version before it serves, and of each swap's outcome (engine.metrics).
        self.observer = observer
        self.lock = asyncio.Lock()

    # -------------------------------------------------------------------- swap
    async def swap(
        self, model: ModelRef, name: str | None, mode: str, abort: bool, available: int | None, options: dict[str, Any]
    ) -> ModelVersionInfo:
        """Swap, and tell the observer the outcome: ok, refused (nothing changed: a bad argument, it does not
        fit, or the engine is not running), failed (the new version did not load; the old one serves) or cancelled
        (the caller was cancelled before the new version served; the old one serves)."""
        # read as the texts they hold: a subclass whose == answers True passed the mode check, ran as whichever mode
        # it was compared with first, and was written into the log line as its __str__ chose (pass41)
        mode, name = plain_value(mode), plain_value(name)
        start = time.monotonic()
        switched: list[tuple[ModelVersion, str]] = []  # the new version and its name, once it serves
        try:
            info = await self._swap(model, name, mode, abort, available, options, switched)
        except asyncio.CancelledError:
            # the caller gave up (asyncio.wait_for, a task cancelled): counted and written as what happened, a
            # change that took effect (a drain runs to its end) or none
            if switched:
                self._took_effect(version_info(*switched[0], 0), mode, start)
            else:
                self._swapped(name, "cancelled")
                logger.info("model swap cancelled model=%s mode=%s source=%s after_s=%.2f",
                            logged(self._shown_name(name)), logged(mode), logged(model_text(model)),
                            time.monotonic() - start)
            raise
        except (InvalidParameterError, ConfigurationError, EngineClosedError, EngineDeadError):
            # a closed or dead engine loads nothing: no model failed, so no "failed" count to alert on and no line,
            # as add_model writes none (its "model swap failed ... error=EngineClosedError" named no model's fault)
            self._swapped(name, "refused")
            raise
        except Exception as exc:
            self._swapped(name, "failed")
            logger.warning("model swap failed model=%s mode=%s source=%s after_s=%.2f error=%s message=%s",
                           logged(self._shown_name(name)), logged(mode), logged(model_text(model)),
                           time.monotonic() - start, type(exc).__name__, logged(str(exc)))
            raise
        self._took_effect(info, mode, start)
        return info

    def _shown_name(self, name: str | None) -> str:
        """The generator swapped, by the name the metrics count it under (it said model=<default> for a swap
        naming none, where the docs' line, the INFO line and asyncinfer_swaps_total say model=default)."""
        return name if name is not None else next(iter(self.models.generators), "<default>")

    def _took_effect(self, info: ModelVersionInfo, mode: str, start: float) -> None:
        self._swapped(info.name, "ok")
        logger.info("model swapped model=%s version=%d mode=%s source=%s took_s=%.2f", logged(info.name),
                    info.version_id, logged(mode), logged(info.source), time.monotonic() - start)

    def _swapped(self, name: str | None, outcome: str) -> None:
        if self.observer is not None:
            self.observer.count_swap(name, outcome)

    async def _swap(
        self, model: ModelRef, name: str | None, mode: str, abort: bool, available: int | None, options: dict[str, Any],
        switched: list[tuple[ModelVersion, str]],
    ) -> ModelVersionInfo:
        if mode not in ("overlap", "drain"):
            raise InvalidParameterError("mode", mode, "'overlap' or 'drain'")
        if not isinstance(abort, bool) or (abort and mode != "drain"):
            raise InvalidParameterError("abort", abort, "True only with mode='drain', else False")
        if name is not None and not isinstance(name, str):
            raise InvalidParameterError("name", name, f"a loaded generator's name, or None: {sorted(self.models.generators)}")
        available = check_available_bytes(available)
        async with self.lock:
            self.check_usable()
            # swap_model's keyword is name, not model; an embedding model is replaced by remove_model + add_model
            holder = self.models.generator(name, "name", "an embedding model, which swap_model does not replace: "
                                                         "remove_model(name), then add_model(name, model)")
            label = self.models.name_of(holder)
            serving = current(holder)
            merged = {**serving.options, **options}
            EngineConfig.from_options(merged)  # bad options fail before anything is read
            admission = self.models.admission[holder]
            drain_began: list[bool] = []  # set once the drain begins (then only a switch gives the model a version)
            if mode == "drain":
                # From the call on, new requests wait for the new version (its checks included), and no version
                # serves: the HTTP server answers them 503 (come back) from here, not from the drain's start (a
                # request sent during the checks waited for the whole swap: docs/model_swaps.md).
                admission.clear()
                holder.current = None
            try:
                try:
                    await self._check_fits(model, merged, available, mode, serving.plan)
                except InvalidParameterError as exc:  # an option the caller did not give: say where it came from
                    if exc.parameter not in serving.options or exc.parameter in options:
                        raise
                    raise InvalidParameterError(exc.parameter, exc.value, exc.allowed, message=(
                        f"{exc} ({exc.parameter} is the serving version's, carried over: pass {exc.parameter}= to "
                        "swap_model for the new model)")) from exc
                if mode == "overlap":
                    new = await self._load_version(model, merged)
                    # from the switch's first line on, new requests bind to it: a cancellation in its wait is late
                    switched.append((new, label))
                    await self.switch(new, holder)
                else:  # from the drain on, the model has no version until one is switched in: see it through
                    new = await _to_the_end(self._drain_swap(holder, serving, model, merged, abort, label, switched,
                                                             drain_began))
            finally:
                if mode == "drain" and not drain_began:  # refused, cancelled or closed before the drain: the old one
                    # serves on (or, the engine closed, answers kv_stats() and its tokenizer as a closed engine's does)
                    holder.current = serving
                admission.set()
            return version_info(new, label, 0)

    async def _check_fits(
        self, model: ModelRef, options: dict[str, Any], available: int | None, mode: str, serving: MemoryPlan
    ) -> None:
        """Refuse, before anything is drained or loaded, a swap whose new version cannot fit: beside the
        serving version (overlap), or in the memory it frees (drain). Suggests drain only where it would fit."""
        freed = serving.weight_bytes + serving.kv_bytes + serving.activation_reserve
        shortfall = None
        if mode == "overlap":
            shortfall = await anyio.to_thread.run_sync(generator_shortfall, model, options, available,
                                                       "the serving one")
            if shortfall is None:
                return
        drained = await anyio.to_thread.run_sync(
            lambda: generator_shortfall(model, options, available, "the other loaded models, even with the serving "
                                        "version freed", freed=freed))
        if shortfall is not None and drained is None:
            raise ConfigurationError(f"{shortfall} (swap with mode='drain', which frees the old one first, fits)")
        if drained is not None:
            if drained.any_memory:
                raise ConfigurationError(f"{drained} (the options not given to swap_model are the serving version's)")
            raise ConfigurationError(str(drained))

    async def _load_version(self, model: ModelRef, options: dict[str, Any]) -> ModelVersion:
        """Load a generator version in a worker thread (a failure is a :class:`SwapError`)."""
        loaded = await self._load(model, options, "generate", SwapError, f"loading {model!r} as a new model version")
        assert isinstance(loaded, ModelVersion)
        return loaded

    async def _load(
        self, model: ModelRef, options: dict[str, Any], kind: str, error: type[ModelLoadError], what: str,
        version_id: int | None = None,
    ) -> ModelVersion | EmbeddingBatcher:
        """:func:`~asyncinfer.loading.load` in a worker thread, with ``version_id`` (else the next version id)."""
        version_id = next(self.version_ids) if version_id is None else version_id
        return await anyio.to_thread.run_sync(
            lambda: load(model, options, version_id=version_id, kind=kind, error=error, what=what)
        )

    async def _drain_swap(
        self, holder: ModelHolder, old: ModelVersion, model: ModelRef, options: dict[str, Any], abort: bool,
        label: str, switched: list[tuple[ModelVersion, str]], drain_began: list[bool],
    ) -> ModelVersion:
        """Drain mode (admission paused and ``holder.current`` cleared by the caller): retire ``old``, the version
        that served, load the new one and switch it in (its info put in ``switched``, what a cancelled caller's count
        reads; ``drain_began`` marked once the engine takes the drain, so that a swap refused before it gives the
        model its version back)."""
        self.check_usable()  # (the engine may have closed since the checks: then nothing drains)
        drain_began.append(True)
        await self.retire(old, abort, holder)
        try:
            new = await self._load_version(model, options)
        except BaseException as failed:
            # The old version is gone already: bring it back so the engine keeps serving.
            try:
                back = await self._load_version(old.path, old.options)
            except BaseException as reload_failed:
                holder.vacancy = (f"a drain-mode swap failed to load its new version and the reload of the old one "
                                  f"failed too: remove_model({label!r}), then add_model({label!r}, model) loads one")
                # the operator's line: the WARNING that follows ("model swap failed") says why the new version did
                # not load, and reads as if the old one served on (it said only why the reload failed, as if that
                # were the new version's fault)
                logger.error("model has no version serving model=%s source=%s error=%s message=%s (a drain-mode "
                             "swap's new version failed to load and so did the reload of the old one: remove_model, "
                             "then add_model loads one)", logged(label), logged(model_text(old.path)),
                             type(reload_failed).__name__, logged(str(reload_failed)))
                raise failed from reload_failed
            await self.switch(back, holder)
            raise
        switched.append((new, label))
        await self.switch(new, holder)
        return new

    async def switch(self, version: ModelVersion, holder: ModelHolder) -> None:
        """Bind new requests to ``version`` and have the engine thread step it (at a step boundary)."""
        self.check_usable()
        if self.observer is not None:
            self.observer.watch(self.models.name_of(holder), version)
        if not self.link.started:  # no step loop yet: nothing can race with us
            holder.switch(version)
            holder.current = version
            holder.retire_idle()
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Requests posted from now on land in the inbox after the switch command.
        holder.current = version
        await self.link.wait_for(done, SwitchVersion(holder, version, self.link.resolver(done)))

    async def retire(self, version: ModelVersion, abort: bool, holder: ModelHolder) -> None:
        """Stop binding requests to ``version``, wait until its last one ends, drop it."""
        self.check_usable()
        holder.current = None
        if not self.link.started:
            holder.drain(version, abort=False)
            holder.retire_idle()
        else:
            retired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            version.on_retired.append(self.link.resolver(retired))
            await self.link.wait_for(retired, DrainVersion(holder, version, abort))
        await anyio.to_thread.run_sync(gc.collect)  # free its tensors before the next load

    # --------------------------------------------------------------------- add
    async def add(self, name: str, model: ModelRef, available: int | None, options: dict[str, Any]) -> ModelVersionInfo:
        start = time.monotonic()
        try:
            info = await self._add(name, model, available, options)
        except ModelLoadError as exc:
            logger.warning("model add failed model=%s source=%s after_s=%.2f error=%s message=%s", logged(str(name)),
                           logged(model_text(model)), time.monotonic() - start, type(exc).__name__, logged(str(exc)))
            raise
        logger.info("model added model=%s kind=%s version=%d source=%s took_s=%.2f", logged(info.name), info.kind,
                    info.version_id, logged(info.source), time.monotonic() - start)
        return info

    async def _add(self, name: str, model: ModelRef, available: int | None, options: dict[str, Any]) -> ModelVersionInfo:
        available = check_available_bytes(available)
        async with self.lock:
            self.check_usable()
            name = self.models.check_free(name)
            path = await anyio.to_thread.run_sync(resolve_model, model)
            options = {"device": self.device, **options}
            label = f"loading {model_text(model)!r} as model {name!r}"
            if await anyio.to_thread.run_sync(is_encoder_dir, path):
                return await self._add_embedder(name, path, options, available, label)
            return await self._add_generator(name, path, options, available, label)

    async def _add_embedder(
        self, name: str, path: Path, options: dict[str, Any], available: int | None, label: str
    ) -> ModelVersionInfo:
        config = EmbeddingConfig.from_options(options)
        shortfall = await anyio.to_thread.run_sync(embedder_shortfall_at, path, config, available)
        if shortfall is not None:
            raise ConfigurationError(shortfall)
        version_id = next(self.version_ids)  # one id, the load's and the entry's: two left a gap in the numbers
        batcher = await self._load(path, options, "embed", ModelLoadError, label, version_id)
        assert isinstance(batcher, EmbeddingBatcher)
        self.check_usable()
        entry = EmbeddingModel(name, version_id, batcher)
        self.models.add_embedder(entry)
        return entry.info(draining=False)

    async def _add_generator(
        self, name: str, path: Path, options: dict[str, Any], available: int | None, label: str
    ) -> ModelVersionInfo:
        shortfall = await anyio.to_thread.run_sync(
            generator_shortfall, path, options, available, "the loaded models", ModelLoadError
        )
        if shortfall is not None:
            raise ConfigurationError(str(shortfall))
        version = await self._load(path, options, "generate", ModelLoadError, label)
        assert isinstance(version, ModelVersion)
        holder = ModelHolder(version)
        self.check_usable()
        if self.observer is not None:
            self.observer.watch(name, version)
        self.models.add_generator(name, holder)
        if self.link.started:
            self.link.post(AddHolder(holder))
        return version_info(version, name, 0)

    # ------------------------------------------------------------------ remove
    async def remove(self, name: str, abort: bool) -> None:
        if not isinstance(abort, bool):
            raise InvalidParameterError("abort", abort, "True or False")
        if not isinstance(name, str):
            raise InvalidParameterError("name", name, f"a loaded model's name: {self.models.loaded_names()}")
        name = plain_value(name)
        async with self.lock:
            self.check_usable()
            if name in self.models.generators:
                await self._remove_generator(name, abort)
            elif name in self.models.embedders:
                await self._remove_embedder(name, abort)
            else:
                raise InvalidParameterError("name", name, f"a loaded model: {self.models.loaded_names()}")
            await anyio.to_thread.run_sync(gc.collect)
        logger.info("model removed model=%s abort=%s", logged(name), abort)

    async def _remove_generator(self, name: str, abort: bool) -> None:
        models = self.models
        holder = models.generators.pop(name)
        models.admission.pop(holder).set()  # requests waiting for it now see it is gone
        models.removing[name] = holder
        try:
            await _to_the_end(self._retire_holder(holder, abort))  # gone from the catalog: see it through
        finally:
            del models.removing[name]

    async def _retire_holder(self, holder: ModelHolder, abort: bool) -> None:
        """Retire every version of ``holder``, the serving one and those still draining after an overlapping swap
        (retiring the serving one alone left the old versions' requests unstepped, their callers waiting for
        ever), and wait until the engine thread no longer steps it."""
        self.check_usable()
        holder.current = None
        if not self.link.started:  # no step loop yet: no version holds a request
            holder.drain_all(abort=False)
            holder.retire_idle()
            return
        removed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self.link.wait_for(removed, RemoveHolder(holder, abort, self.link.resolver(removed)))

    async def _remove_embedder(self, name: str, abort: bool) -> None:
        models = self.models
        entry = models.embedders.pop(name)
        models.removing[name] = entry
        try:
            if entry.calls:
                if abort:
                    self.link.post(AbortEmbeds(entry.batcher, "the embedding model was removed with abort=True"))
                entry.drained = asyncio.get_running_loop().create_future()
                await self.link.wait_for(entry.drained)
        finally:
            del models.removing[name]


async def _to_the_end(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end even if the caller is cancelled meanwhile, then raise the cancellation (or
    ``work``'s own error). For a change that, once begun, leaves a model with no version (a drain-mode swap
    retiring the serving one) or half removed until it ends: cancelled in its drain (``asyncio.wait_for`` on
    ``swap_model``), the swap left the model with no version at all, every later request refused with
    EngineClosedError, and a removal never told the engine thread to stop stepping the model."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the work itself was cancelled (not the caller): its error
                raise
            cancelled = True  # the caller's: wait for the work first
    if cancelled:
        raise asyncio.CancelledError
    return result
