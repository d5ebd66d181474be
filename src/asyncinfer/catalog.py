"""The event loop's view of an engine's named models.

Generators are :class:`ModelHolder` objects (their versions, and the one new
requests are bound to); embedding models are :class:`EmbeddingModel` entries
(their batcher and the ``embed()`` calls in flight). The first loaded model of
each kind is the default. A model being removed stays in ``removing`` (listed
as "draining") until it is gone. Only the event loop touches this; the engine
thread has its own list of holders.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from asyncinfer.core import EngineCore
from asyncinfer.embedding import EmbedCall, EmbeddingBatcher
from asyncinfer.engine_thread import QueueEmbed
from asyncinfer.errors import EngineClosedError, InvalidParameterError, RequestAbortedError
from asyncinfer.holder import ModelHolder, ModelVersion, ModelVersionInfo, VersionState
from asyncinfer.plain import plain_value
from asyncinfer.prompts import (
    LoopShare,
    check_prompt_chars,
    check_unicode,
    prompt_cost,
    prompt_token_ids,
    texts_cost,
)
from asyncinfer.threads import WorkShares

_M = TypeVar("_M")


@dataclass(eq=False)
class EmbeddingModel:
    """An embedding model as the event loop sees it: its batcher and the calls in flight."""

    name: str
    version_id: int
    batcher: EmbeddingBatcher
    calls: dict[EmbedCall, asyncio.Future[torch.Tensor]] = field(default_factory=dict)
    drained: asyncio.Future[None] | None = None  # set by remove_model, resolved when calls is empty

    def forget(self, call: EmbedCall) -> None:
        """Drop a finished (or abandoned) call; resolve ``drained`` once none is left."""
        self.calls.pop(call, None)
        if not self.calls and self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def info(self, draining: bool) -> ModelVersionInfo:
        state = "draining" if draining else "current"
        return ModelVersionInfo(
            self.version_id, self.batcher.encoder.source, state, len(self.calls), self.batcher.plan, self.name, "embed",
            embedding_dim=self.batcher.encoder.dimension,
        )


class EmbedCalls:
    """The ``embed()`` calls in flight, each with the future its caller awaits."""

    def __init__(self, loop_share: LoopShare | None = None, work_shares: WorkShares | None = None) -> None:
        self._calls: dict[EmbedCall, tuple[EmbeddingModel, asyncio.Future[torch.Tensor]]] = {}
        self.loop_share = loop_share or LoopShare()  # the engine's tokenizing on the loop, per turn
        self.work_shares = work_shares or WorkShares()  # and off it: each tenant's few worker threads

    def __len__(self) -> int:
        return len(self._calls)

    def open(self, entry: EmbeddingModel, call: EmbedCall) -> asyncio.Future[torch.Tensor]:
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        entry.calls[call] = future
        self._calls[call] = (entry, future)
        return future

    async def submit(
        self, entry: EmbeddingModel, texts: list[str], post: Callable[[Any], None], still_ok: Callable[[], None],
        tenant: str | None = None,
    ) -> torch.Tensor:
        """Tokenize ``texts`` (off the loop when long), queue them on ``entry`` for ``tenant`` and await the vectors.

        ``still_ok`` raises if the engine or the model went away while tokenizing off the loop.
        """
        tokenize = entry.batcher.encoder.tokenize
        if not self.loop_share.take(texts_cost(texts)):
            # a cancel waits for it: its worker thread is held; one of its tenant's threads
            ids = await self.work_shares.run(None if tenant is None else ("tenant", tenant), tokenize, texts)
            still_ok()
        else:
            ids = tokenize(texts)
        call = EmbedCall(ids, time.monotonic(), tenant)
        future = self.open(entry, call)
        post(QueueEmbed(entry.batcher, call))
        try:
            return await future
        finally:
            # A caller that went away (its task cancelled, which cancels the future
            # too): the engine thread skips the call's texts still queued.
            call.cancelled = future.cancelled() or not future.done()
            self.close(call)

    def close(self, call: EmbedCall) -> None:
        item = self._calls.pop(call, None)
        if item is not None:
            item[0].forget(call)

    def resolve(self, call: EmbedCall, result: torch.Tensor | BaseException) -> None:
        """The engine thread's answer for ``call``: its vectors, or why it failed."""
        item = self._calls.get(call)
        if item is None or item[1].done():
            return
        if isinstance(result, RequestAbortedError):
            item[1].set_exception(result)
        elif isinstance(result, BaseException):
            err = RequestAbortedError(f"the embedding batch failed: {result!r}")
            err.__cause__ = result
            item[1].set_exception(err)
        else:
            item[1].set_result(result)

    def fail_all(self, make_error: type[BaseException], message: str, cause: BaseException) -> None:
        for _entry, future in list(self._calls.values()):
            if not future.done():
                err = make_error(message)
                err.__cause__ = cause
                future.set_exception(err)


class ModelCatalog:
    """Named generators and embedding models, in load order."""

    def __init__(self, loop_share: LoopShare | None = None, work_shares: WorkShares | None = None) -> None:
        self.loop_share = loop_share or LoopShare()  # the engine's tokenizing on the loop, per turn
        self.work_shares = work_shares or WorkShares()  # and off it: each tenant's few worker threads
        self.generators: dict[str, ModelHolder] = {}
        self.embedders: dict[str, EmbeddingModel] = {}
        self.removing: dict[str, ModelHolder | EmbeddingModel] = {}
        # Per generator: cleared while a drain-mode swap has no version serving.
        self.admission: dict[ModelHolder, asyncio.Event] = {}

    def add_generator(self, name: str, holder: ModelHolder) -> None:
        self.generators[name] = holder
        admission = asyncio.Event()
        admission.set()
        self.admission[holder] = admission

    def add_embedder(self, entry: EmbeddingModel) -> None:
        self.embedders[entry.name] = entry

    def generator(self, name: str | None, parameter: str = "model",
                  embedder_hint: str = "an embedding model: use embed()") -> ModelHolder:
        """The generator named ``name`` (None: the default one); an error names ``parameter``, the caller's keyword,
        and ``embedder_hint`` where ``name`` is an embedding model's."""
        return _pick(self.generators, name, "generator", self.embedders, embedder_hint, parameter)

    def embedder(self, name: str | None) -> EmbeddingModel:
        """The embedding model named ``name`` (None: the default one)."""
        return _pick(self.embedders, name, "embedding model", self.generators, "a generator: use generate() or stream()")

    async def admit(self, name: str | None, check_running: Any) -> ModelVersion:
        """The version a new request to generator ``name`` is bound to; waits while a
        drain-mode swap holds its admission, from the swap's call to the new version's switch
        (requests wait, they do not fail). EngineClosedError where no version serves after it
        (a drain-mode swap whose new version and reload both failed)."""
        while True:
            check_running()
            holder = self.generator(name)
            admission = self.admission[holder]
            if admission.is_set():
                return current(holder)
            await admission.wait()

    def serving(self, name: str | None) -> ModelVersion | None:
        """The version a request to generator ``name`` would be bound to now; None while a drain-mode
        swap holds its admission (or no version serves)."""
        holder = self.generator(name)
        return holder.current if self.admission[holder].is_set() else None

    def tokenize_now(self, name: str | None, prompt: Any) -> tuple[ModelVersion, list[int]] | None:
        """The serving version and the prompt's ids for it, when that takes no await: None
        while a drain-mode swap has no version serving, or for a text tokenized off the loop (over
        ``OFF_LOOP_CHARS``, or past the loop's share of this turn: :class:`LoopShare`; only its length
        bounds are checked then). Raises for an unknown model or a bad prompt."""
        version = self.generator(name).current
        if version is None:
            return None
        check_prompt_chars(prompt, version)
        if not self.loop_share.take(prompt_cost(prompt)):
            return None
        return version, prompt_token_ids(prompt, version)

    async def bind_prompt(
        self, name: str | None, prompt: Any, check_running: Any, early: tuple[ModelVersion, list[int]] | None = None,
        party: Hashable | None = None,
    ) -> tuple[ModelVersion, list[int]]:
        """The version a new request is bound to, and its prompt's token ids for that version.

        ``early``: ids computed at the call, reused if their version still serves.
        Long texts are tokenized off the loop, in one of ``party``'s worker threads
        (:class:`~asyncinfer.threads.WorkShares`; None: a work thread as they come); if a swap moved the generator to
        another version meanwhile, the prompt is tokenized again for that one.
        """
        while True:
            version = await self.admit(name, check_running)
            if early is not None and early[0] is version:
                return early
            check_prompt_chars(prompt, version)
            if self.loop_share.take(prompt_cost(prompt)):
                return version, prompt_token_ids(prompt, version)
            ids = await self.work_shares.run(party, prompt_token_ids, prompt, version)  # a cancel waits for it
            if self.serving(name) is version:
                return version, ids

    def tokenizer_of(self, name: str | None) -> Any:
        """The tokenizer of the model ``name``, generator or embedding model (None: the default generator)."""
        name = plain_value(name)  # the plain str it holds, as _pick reads it
        if isinstance(name, str) and name in self.embedders:
            return self.embedders[name].batcher.encoder.tokenizer
        return current(self.generator(name)).tokenizer

    def core(self, name: str | None) -> EngineCore:
        """The core of generator ``name``'s current version."""
        core = current(self.generator(name)).core
        assert core is not None
        return core

    def reset_prefix_caches(self) -> None:
        """Forget every generator's cached prefixes (only while no engine thread runs)."""
        for holder in self.generators.values():
            holder.reset_prefix_cache()

    def name_of(self, holder: ModelHolder) -> str:
        return next(n for n, h in self.generators.items() if h is holder)

    def check_free(self, name: str) -> str:
        """``name`` as the plain ``str`` it holds (:func:`check_name`), when no model holds or is leaving it."""
        name = check_name(name)
        taken = {*self.generators, *self.embedders, *self.removing}
        if name in taken:
            raise InvalidParameterError("name", name, f"a name not in use (in use: {sorted(taken)})")
        return name

    def loaded_names(self) -> list[str]:
        return sorted({*self.generators, *self.embedders})

    def open_all_admissions(self) -> None:
        for admission in self.admission.values():
            admission.set()

    def infos(self, in_flight: Any) -> list[ModelVersionInfo]:
        """Every live model: generators (each live version, oldest first), then embedding models.

        ``in_flight(version_id)`` counts the requests bound to a generator's version.
        """
        infos: list[ModelVersionInfo] = []
        for name, holder in [*self.generators.items(), *self.removing.items()]:
            if isinstance(holder, ModelHolder):
                infos.extend(
                    version_info(v, name, in_flight(v.version_id))
                    for v in list(holder.live) if v.state is not VersionState.RETIRED
                )
        for name, entry in [*self.embedders.items(), *self.removing.items()]:
            if isinstance(entry, EmbeddingModel):
                infos.append(entry.info(name in self.removing))
        return infos


def version_info(version: ModelVersion, name: str, in_flight: int) -> ModelVersionInfo:
    seconds = None if version.core is None else version.core.runner.compile_seconds
    return ModelVersionInfo(
        version.version_id, version.source, version.state.value, in_flight, version.plan, name, "generate",
        compile_seconds=seconds,
    )


def current(holder: ModelHolder) -> ModelVersion:
    """The version new requests to ``holder`` are bound to."""
    version = holder.current
    if version is None:
        raise EngineClosedError(f"no model version is serving ({holder.vacancy})")
    return version


def check_name(name: Any) -> str:
    """A model's name as the plain ``str`` it holds, checked: a ``str`` subclass's own ``__len__`` cannot pass a
    name of any length (it is in every metric's labels and every ``/v1/models`` answer), and the engine keeps
    no object whose methods are the caller's."""
    name = plain_value(name)
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InvalidParameterError("name", name, "a non-empty string of at most 200 characters")
    # valid Unicode: the name is in every metric series' labels, the /v1/models answer and the log lines, each
    # written as UTF-8; one lone surrogate made every /metrics scrape of the engine a UnicodeEncodeError
    check_unicode("name", name)
    return name


def _pick(models: dict[str, _M], name: Any, kind: str, others: dict[str, Any], hint: str, parameter: str = "model") -> _M:
    """``models[name]``, or the first loaded when ``name`` is None; a clear error otherwise. ``name`` is looked up as
    the plain ``str`` it holds (:func:`~asyncinfer.plain.plain_value`): a subclass's ``__hash__`` or ``__eq__`` that
    raised came out of every call naming a model (``generate``, ``kv_stats``, ``get_tokenizer``, ...) as itself."""
    name = plain_value(name)
    if name is None:
        if not models:
            article = "an" if kind[0] in "aeiou" else "a"
            raise InvalidParameterError(
                parameter, None, f"{article} {kind}'s name", message=f"no model was named and this engine holds no "
                f"{kind} to default to: add {article} {kind} with add_model(), or name one it holds")
        return next(iter(models.values()))
    found = models.get(name) if isinstance(name, str) else None
    if found is None:
        extra = f" ({hint})" if isinstance(name, str) and name in others else ""
        raise InvalidParameterError(parameter, name, f"a loaded {kind}: {sorted(models)}{extra}")
    return found
