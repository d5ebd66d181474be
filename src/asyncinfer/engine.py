"""AsyncEngine: the public, asyncio face of the engine.

The application's event loop only tokenizes, validates and waits. All model
work runs in one dedicated thread that drives :class:`EngineCore`'s step loop;
results come back through ``loop.call_soon_threadsafe`` into one queue per
request. The engine holds no process-global state: several engines can live in
one process (one per Ray Serve replica, say).
"""

from __future__ import annotations

import asyncio
import enum
import gc
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch

from asyncinfer.cache.kv_manager import KVCacheManager, KVCacheStats
from asyncinfer.config import EngineConfig
from asyncinfer.core import CoreOutput, EngineCore, StepStats, default_eos_ids
from asyncinfer.embedding import (
    EmbedCall,
    EmbeddingBatcher,
    EmbeddingConfig,
    EmbeddingPlan,
    EmbeddingStats,
    apply_max_seq_len,
    plan_embedding,
)
from asyncinfer.errors import (
    ConfigurationError,
    EngineClosedError,
    EngineDeadError,
    InvalidParameterError,
    ModelLoadError,
    RequestAbortedError,
    SwapError,
)
from asyncinfer.holder import ModelHolder, ModelVersion, ModelVersionInfo, VersionState
from asyncinfer.memory import (
    MiB,
    MemoryPlan,
    available_memory,
    plan_for_engine,
    plan_memory,
    resolve_max_model_len,
)
from asyncinfer.model_source import resolve_model
from asyncinfer.models import LoadedModel, ModelConfig, load_model
from asyncinfer.models.encoder import is_encoder_dir, load_encoder, read_encoder_config
from asyncinfer.models.quant import quantized_weight_bytes
from asyncinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StreamDelta
from asyncinfer.request import Request
from asyncinfer.runner import ModelRunner
from asyncinfer.sampler import Sampler
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers.base import SchedulerConfig
from asyncinfer.schedulers.registry import create_scheduler

logger = logging.getLogger("asyncinfer")

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


class EngineState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    DEAD = "dead"


class _Stream:
    """One request's output queue on the event loop side (all ``n`` samples share it)."""

    __slots__ = ("queue", "finished", "n", "num_done", "ids", "version_id")

    def __init__(self, n: int, ids: tuple[str, ...], version_id: int) -> None:
        self.queue: asyncio.Queue[CoreOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.n = n
        self.num_done = 0  # samples whose last output was delivered to the queue
        self.ids = ids  # the core's request ids of the samples
        self.version_id = version_id  # the model version the request is bound to


@dataclass(eq=False)
class _EmbeddingModel:
    """An embedding model as the event loop sees it: its batcher and the calls in flight."""

    name: str
    version_id: int
    source: str
    batcher: EmbeddingBatcher
    calls: dict[EmbedCall, asyncio.Future[torch.Tensor]] = field(default_factory=dict)
    drained: asyncio.Future[None] | None = None  # set by remove_model, resolved when calls is empty


class AsyncEngine:
    """An in-process LLM engine: ``async with AsyncEngine.from_pretrained() as engine``.

    Build it with :meth:`from_pretrained`; start it with ``async with`` (or
    :meth:`start`); use :meth:`generate` and :meth:`stream` from any task.
    One engine can hold several named models (:meth:`add_model`), generators
    and embedding models (:meth:`embed`); ``model=`` picks one, the first
    loaded of each kind is the default.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        name: str = "default",
        version: ModelVersion | None = None,
        embedder: EmbeddingBatcher | None = None,
    ) -> None:
        self.config = config
        self._version_ids = itertools.count(1 if version is None else version.version_id + 1)
        # Loop side: the named models, in load order (the first of each kind is the default).
        self._generators: dict[str, ModelHolder] = {}
        self._embedders: dict[str, _EmbeddingModel] = {}
        self._removing: dict[str, ModelHolder | _EmbeddingModel] = {}  # removed, still finishing requests
        # Per generator: cleared while a drain-mode swap has no version serving.
        self._admission: dict[ModelHolder, asyncio.Event] = {}
        if version is not None:
            self._register_generator(name, ModelHolder(version))
        if embedder is not None:
            self._embedders[name] = _EmbeddingModel(name, next(self._version_ids), embedder.encoder.source, embedder)
        # Engine-thread side: the holders it steps and the batchers with queued texts.
        self._thread_holders: list[ModelHolder] = []
        self._thread_batchers: list[EmbeddingBatcher] = []
        self._embed_calls: dict[EmbedCall, tuple[_EmbeddingModel, asyncio.Future[torch.Tensor]]] = {}
        self._swap_lock = asyncio.Lock()  # one swap / add / remove at a time
        self._waiters: set[asyncio.Future[None]] = set()  # swaps waiting on the engine thread
        self._state = EngineState.CREATED
        self._streams: dict[str, _Stream] = {}
        self._ids_in_flight: set[str] = set()  # every sample's core id, for collision checks
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_cause: BaseException | None = None
        self._ids = itertools.count()

    # ---------------------------------------------------------------- building
    @classmethod
    def from_pretrained(
        cls, model: str | os.PathLike[str] | None = None, *, name: str = "default", **options: Any
    ) -> AsyncEngine:
        """Load a model and plan memory; the engine starts on ``async with`` / :meth:`start`.

        ``model``: a Hugging Face model directory (config.json + safetensors), a
        ``.gguf`` file, a known name ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"),
        or ``None`` for the default model (SmolLM2-135M-Instruct). A BERT-family
        sentence encoder makes an embedding-only engine (:meth:`embed`).
        ``name``: the model's name for ``model=`` (more models: :meth:`add_model`).
        ``options``: the fields of :class:`~asyncinfer.config.EngineConfig`
        (:class:`~asyncinfer.embedding.EmbeddingConfig` for an embedding model);
        an unknown one raises :class:`InvalidParameterError`.

        Raises:
            InvalidParameterError: an unknown option or an out-of-range value.
            ModelLoadError: the model cannot be found or loaded.
            ConfigurationError: the KV cache cannot hold one ``max_model_len`` request.
        """
        _check_name(name)
        path = resolve_model(model)
        if is_encoder_dir(path):
            econfig = EmbeddingConfig.from_options(options)
            if econfig.num_threads is not None:
                torch.set_num_threads(econfig.num_threads)
            batcher = _load_embedder(path, econfig, ModelLoadError, f"loading {str(path)!r}")
            config = EngineConfig(dtype=econfig.dtype, device=econfig.device, num_threads=econfig.num_threads)
            return cls(config=config, name=name, embedder=batcher)
        config = EngineConfig.from_options(options)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(path, config.dtype, config.device)
        plan, core = _build_core(loaded, config)
        return cls(config=config, name=name, version=_make_version(0, loaded, config, dict(options), plan, core))

    @classmethod
    def plan_memory(
        cls, model: str | os.PathLike[str] | None = None, *, available_bytes: int | None = None, **options: Any
    ) -> MemoryPlan | EmbeddingPlan:
        """The memory plan :meth:`from_pretrained` would make, computed before loading any weight.

        Reads only the model's config (config.json or the GGUF header) and
        estimates the weights from its shapes in the chosen dtype. Takes the
        same options as :meth:`from_pretrained`; ``available_bytes`` overrides
        the memory measured as free now (before loading). For an embedding
        model it is an :class:`EmbeddingPlan` (weights + the activations of its
        largest batch), and ``ConfigurationError`` if that exceeds the memory.

        Raises:
            InvalidParameterError: an unknown option or an out-of-range value.
            ModelLoadError: the model's config cannot be read.
            ConfigurationError: the KV cache cannot hold one ``max_model_len`` request.
        """
        if isinstance(model, ModelConfig):  # a generator's config, given directly
            return plan_memory(model, available_bytes=available_bytes, **options)
        path = resolve_model(model)
        if is_encoder_dir(path):
            config = EmbeddingConfig.from_options(options)
            plan = plan_embedding(read_encoder_config(path), config)
            shortfall = _embedder_shortfall(plan, config, available_bytes)
            if shortfall is not None:
                raise ConfigurationError(shortfall)
            return plan
        return plan_memory(path, available_bytes=available_bytes, **options)

    # --------------------------------------------------------------- lifecycle
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def max_model_len(self) -> int:
        return self._version.max_model_len

    @property
    def _holder(self) -> ModelHolder:
        """The default generator: the first loaded that is still loaded."""
        return self._generator(None)

    def _generator(self, model: str | None) -> ModelHolder:
        """The generator named ``model`` (None: the default one)."""
        return _pick(self._generators, model, "generator", self._embedders, "an embedding model: use embed()")

    def _embedder(self, model: str | None) -> _EmbeddingModel:
        """The embedding model named ``model`` (None: the default one)."""
        return _pick(self._embedders, model, "embedding model", self._generators,
                     "a generator: use generate() or stream()")

    def _register_generator(self, name: str, holder: ModelHolder) -> None:
        self._generators[name] = holder
        admission = asyncio.Event()
        admission.set()
        self._admission[holder] = admission

    @property
    def _version(self) -> ModelVersion:
        """The version new requests to the default generator are bound to."""
        return _current(self._holder)

    @property
    def _core(self) -> EngineCore:
        core = self._version.core
        assert core is not None
        return core

    @property
    def model_config(self) -> ModelConfig:
        """The current version's model config."""
        return self._version.model_config

    @property
    def tokenizer(self) -> Any:
        """The current version's tokenizer (None for a model without tokenizer files)."""
        return self._version.tokenizer

    @property
    def model_source(self) -> str:
        return self._version.source

    @property
    def memory_plan(self) -> MemoryPlan:
        return self._version.plan

    async def start(self) -> None:
        """Start the step-loop thread, bound to the running event loop."""
        if self._state is not EngineState.CREATED:
            raise EngineClosedError(f"the engine cannot be started again (state: {self._state.value})")
        self._loop = asyncio.get_running_loop()
        self._thread_holders = list(self._generators.values())
        self._thread = threading.Thread(target=self._run_core, name="asyncinfer-core", daemon=True)
        self._state = EngineState.RUNNING
        self._thread.start()

    async def aclose(self, *, abort: bool = False) -> None:
        """Stop accepting requests, let in-flight ones finish (or abort them), stop the thread."""
        if self._state in (EngineState.CREATED, EngineState.CLOSED):
            self._state = EngineState.CLOSED
            return
        if self._state is EngineState.RUNNING:
            self._state = EngineState.CLOSING
            for admission in self._admission.values():
                admission.set()  # requests waiting on a drain-mode swap now see the engine closing
            self._post("stop", abort)
        if self._thread is not None:
            await anyio.to_thread.run_sync(self._thread.join)
        if self._state is not EngineState.DEAD:
            self._state = EngineState.CLOSED

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Leaving the block because of an error or a cancellation aborts what is
        # in flight instead of waiting for it.
        await self.aclose(abort=exc_type is not None)

    # ------------------------------------------------------------- public API
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        model: str | None = None,
    ) -> RequestOutput:
        """Run one request to its end and return the whole result.

        With ``params.n > 1`` the result's ``outputs`` holds every sample (its
        flat fields are sample 0's). ``cache_salt``: requests share cached prompt
        prefixes only with requests of the same salt (e.g. one per tenant).

        Cancelling the awaiting task aborts the request (its KV blocks return at
        the next step boundary). A request aborted with :meth:`abort` returns
        with ``finish_reason == "abort"``. ``model``: the name of the generator
        to use (default: the first loaded).

        Raises:
            InvalidParameterError: bad prompt or parameters (nothing was queued).
            EngineClosedError: the engine is not running.
            EngineDeadError: the step loop failed.
        """
        version = await self._admit(model)
        request = self._make_request(prompt, params, request_id, priority, cache_salt, version)
        n = request.params.n
        want_logprobs = request.params.logprobs is not None
        token_ids: list[list[int]] = [[] for _ in range(n)]
        pieces: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[Logprob]] = [[] for _ in range(n)]
        last: list[CoreOutput | None] = [None] * n
        async for out in self._submit(request, version):
            i = out.index
            token_ids[i].extend(out.token_ids)
            pieces[i].append(out.text)
            if out.logprobs:
                logprobs[i].extend(out.logprobs)
            last[i] = out
        finals = [out for out in last if out is not None]
        assert len(finals) == n and all(out.finish_reason is not None for out in finals)
        completions = [
            CompletionOutput(
                index=i,
                token_ids=token_ids[i],
                text="".join(pieces[i]),
                finish_reason=out.finish_reason,  # type: ignore[arg-type]
                logprobs=logprobs[i] if want_logprobs else None,
                stop_reason=out.stop_reason,
            )
            for i, out in enumerate(finals)
        ]
        first_times = [out.first_token_time for out in finals if out.first_token_time is not None]
        finish_times = [out.finish_time for out in finals if out.finish_time is not None]
        head = completions[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=head.token_ids,
            text=head.text,
            finish_reason=head.finish_reason,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_token_time=min(first_times, default=None),
                finish_time=max(finish_times, default=None),
                num_preemptions=sum(out.num_preemptions for out in finals),
            ),
            logprobs=head.logprobs,
            stop_reason=head.stop_reason,
            outputs=completions,
        )

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        model: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Yield :class:`StreamDelta` pieces as tokens are generated; the last has ``finish_reason``.

        With ``params.n > 1`` the samples' deltas interleave, told apart by
        ``delta.index``; each sample's last delta has ``finish_reason`` and the
        stream ends after all ``n`` have finished.
        Breaking out of the loop or cancelling the consuming task aborts the request.
        Raises the same errors as :meth:`generate`, before the first delta.
        """
        version = await self._admit(model)
        request = self._make_request(prompt, params, request_id, priority, cache_salt, version)
        async for out in self._submit(request, version):
            yield StreamDelta(
                request_id=out.request_id,
                text=out.text,
                token_ids=out.token_ids,
                finish_reason=out.finish_reason,  # type: ignore[arg-type]
                logprobs=out.logprobs,
                index=out.index,
            )

    def abort(self, request_id: str) -> None:
        """Abort a request by id at the next step boundary (unknown or finished ids are ignored)."""
        if self._state in (EngineState.RUNNING, EngineState.CLOSING):
            self._post("abort", request_id)

    def kv_stats(self, model: str | None = None) -> KVCacheStats:
        """A snapshot of the KV cache figures: blocks used/free/cached-free, usage, waste,
        prefix-cache queries and hits (tokens), copy-on-write copies, evictions, preemptions.

        Read while the engine runs it is a snapshot taken between two steps at best
        (the numbers are plain ints; a torn read is off by one step, never corrupt).
        ``model``: which generator (default: the first loaded).
        """
        core = _current(self._generator(model)).core
        assert core is not None
        return core.kv.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, at the next step boundary.

        Requests submitted after this call never reuse blocks cached before it;
        requests in flight keep the blocks they hold but add nothing to the new cache.
        Every generator's cache is reset.
        """
        if self._state in (EngineState.RUNNING, EngineState.CLOSING):
            self._post("reset_prefix_cache", None)
        else:  # no step loop is running: nothing can race with it
            for holder in self._generators.values():
                holder.reset_prefix_cache()

    # ------------------------------------------------------------- model swaps
    async def swap_model(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        name: str | None = None,
        mode: str = "overlap",
        abort: bool = False,
        available_bytes: int | None = None,
        **options: Any,
    ) -> ModelVersionInfo:
        """Replace a served generator; returns once the new version takes requests.

        ``name``: which generator (default: the first loaded); the new version
        keeps the name.
        ``model`` is what :meth:`from_pretrained` takes; ``options`` override the
        current version's engine options (the others carry over). The new
        version is loaded and warmed up in a worker thread while the current one
        keeps serving, then switched in at a step boundary. Requests keep the
        version they were admitted on; the old version is dropped (weights, KV
        tensors, prefix cache) once its last request ends.

        ``mode="overlap"`` (default) needs the new version's weights, KV cache
        and activation reserve to fit beside the old one in the memory available
        now (``available_bytes`` overrides the measurement). ``mode="drain"``
        pauses admission (new requests wait, they do not fail), lets the old
        version finish its requests (or aborts them with ``abort=True``), drops
        it, then loads the new one. A swap waits for a swap in progress.

        Raises:
            InvalidParameterError: a bad ``mode``, ``name`` or option; nothing was loaded.
            ConfigurationError: overlap mode and the new version does not fit
                beside the old one (the message has the numbers).
            SwapError: the new version could not be loaded, checked or warmed
                up; the old version keeps serving (in drain mode it is loaded
                again from its source).
            EngineClosedError / EngineDeadError: the engine is not running.
        """
        if mode not in ("overlap", "drain"):
            raise InvalidParameterError("mode", mode, "'overlap' or 'drain'")
        if not isinstance(abort, bool) or (abort and mode != "drain"):
            raise InvalidParameterError("abort", abort, "True only with mode='drain', else False")
        async with self._swap_lock:
            self._check_swappable()
            holder = self._generator(name)
            label = next(n for n, h in self._generators.items() if h is holder)
            old = _current(holder)
            merged = {**old.options, **options}
            config = EngineConfig.from_options(merged)
            shortfall = await anyio.to_thread.run_sync(_check_fit, model, merged, available_bytes, "the serving one")
            if shortfall is not None and mode == "overlap":
                raise ConfigurationError(shortfall.rstrip(".") + ". Swap with mode='drain', or lower"
                                         " kv_cache_memory / kv_cache_fraction / max_model_len.")
            if mode == "overlap":
                new = await anyio.to_thread.run_sync(_load_version, model, config, merged, next(self._version_ids))
                await self._switch(new, holder)
                return self._info(new, label)
            admission = self._admission[holder]
            admission.clear()
            try:
                await self._retire(old, abort, holder)
                try:
                    new = await anyio.to_thread.run_sync(
                        _load_version, model, config, merged, next(self._version_ids)
                    )
                except BaseException:
                    # The old version is gone already: bring it back so the engine keeps serving.
                    back = await anyio.to_thread.run_sync(
                        _load_version, old.path, old.config, old.options, next(self._version_ids)
                    )
                    await self._switch(back, holder)
                    raise
                await self._switch(new, holder)
                return self._info(new, label)
            finally:
                admission.set()

    # ---------------------------------------------------------- several models
    async def add_model(
        self,
        name: str,
        model: str | os.PathLike[str] | None,
        *,
        available_bytes: int | None = None,
        **options: Any,
    ) -> ModelVersionInfo:
        """Load another model into this engine under ``name``; returns once it serves.

        ``model`` is what :meth:`from_pretrained` takes. A BERT-family sentence
        encoder (e.g. "all-MiniLM-L6-v2") becomes an embedding model for
        :meth:`embed`, with :class:`~asyncinfer.embedding.EmbeddingConfig`
        options; anything else a generator with its own engine options, KV cache
        and prefix cache (``kv_cache_memory`` / ``kv_cache_fraction`` set its
        share; the fraction is of the memory free when it is added). ``device``
        defaults to the engine's. The model is loaded and warmed up in a worker
        thread while the others keep serving.

        Before loading, its memory (weights + KV cache + activation reserve for a
        generator; weights + the activations of its largest batch for an
        embedding model) is checked against the memory available now
        (``available_bytes`` overrides the measurement).

        Raises:
            InvalidParameterError: a bad or taken ``name``, or a bad option.
            ConfigurationError: the model does not fit beside the loaded ones (with the numbers).
            ModelLoadError: the model cannot be found, loaded or warmed up; nothing changed.
            EngineClosedError / EngineDeadError: the engine is not running.
        """
        _check_name(name)
        if available_bytes is not None and (isinstance(available_bytes, bool) or not isinstance(available_bytes, int)
                                            or available_bytes < 0):
            raise InvalidParameterError("available_bytes", available_bytes, "a byte count >= 0, or None")
        async with self._swap_lock:
            self._check_swappable()
            if name in self._generators or name in self._embedders or name in self._removing:
                taken = sorted({*self._generators, *self._embedders, *self._removing})
                raise InvalidParameterError("name", name, f"a name not in use (in use: {taken})")
            path = await anyio.to_thread.run_sync(resolve_model, model)
            options = {"device": self.config.device, **options}
            label = f"loading {str(model)!r} as model {name!r}"
            if await anyio.to_thread.run_sync(is_encoder_dir, path):
                econfig = EmbeddingConfig.from_options(options)
                shortfall = await anyio.to_thread.run_sync(_check_embedder_fit, path, econfig, available_bytes)
                if shortfall is not None:
                    raise ConfigurationError(shortfall + " Lower max_batch_size / max_seq_len.")
                batcher = await anyio.to_thread.run_sync(_load_embedder, path, econfig, ModelLoadError, label)
                entry = _EmbeddingModel(name, next(self._version_ids), batcher.encoder.source, batcher)
                self._embedders[name] = entry
                return self._embedder_info(entry)
            config = EngineConfig.from_options(options)
            shortfall = await anyio.to_thread.run_sync(
                _check_fit, path, options, available_bytes, "the loaded models", ModelLoadError
            )
            if shortfall is not None:
                raise ConfigurationError(
                    shortfall.rstrip(".") + ". Lower kv_cache_memory / kv_cache_fraction / max_model_len."
                )
            version = await anyio.to_thread.run_sync(
                _load_version, path, config, options, next(self._version_ids), ModelLoadError, label
            )
            holder = ModelHolder(version)
            self._check_swappable()
            self._register_generator(name, holder)
            if self._state is EngineState.RUNNING:
                self._post("add_holder", holder)
            return self._info(version, name)

    async def remove_model(self, name: str, *, abort: bool = False) -> None:
        """Unload the model ``name``; returns once its weights and caches are freed.

        New requests naming it fail with :class:`InvalidParameterError` at once;
        the requests it holds finish first (generation requests end with
        ``finish_reason="abort"``, and waiting ``embed()`` calls raise
        :class:`RequestAbortedError`, with ``abort=True``). If it was the default
        model of its kind, the next one loaded becomes the default.

        Raises:
            InvalidParameterError: no model is loaded under ``name``.
            EngineClosedError / EngineDeadError: the engine is not running.
        """
        if not isinstance(abort, bool):
            raise InvalidParameterError("abort", abort, "True or False")
        async with self._swap_lock:
            self._check_swappable()
            if name in self._generators:
                holder = self._generators.pop(name)
                self._admission.pop(holder).set()  # requests waiting for it now see it is gone
                self._removing[name] = holder
                try:
                    version = holder.current
                    if version is not None:
                        await self._retire(version, abort, holder)
                    if self._state is EngineState.RUNNING:
                        self._post("remove_holder", holder)
                finally:
                    del self._removing[name]
            elif name in self._embedders:
                entry = self._embedders.pop(name)
                self._removing[name] = entry
                try:
                    if entry.calls:
                        if abort:
                            self._post("abort_embeds", entry.batcher)
                        entry.drained = asyncio.get_running_loop().create_future()
                        self._waiters.add(entry.drained)
                        try:
                            await entry.drained
                        finally:
                            self._waiters.discard(entry.drained)
                finally:
                    del self._removing[name]
                await anyio.to_thread.run_sync(gc.collect)
            else:
                loaded = sorted({*self._generators, *self._embedders})
                raise InvalidParameterError("name", name, f"a loaded model: {loaded}")

    async def embed(self, texts: str | Sequence[str], *, model: str | None = None) -> torch.Tensor:
        """Sentence embeddings of ``texts``: a float32 CPU tensor ``[len(texts), dim]``.

        Rows are unit-length when the model normalises (sentence-transformers'
        Normalize module; all-MiniLM-L6-v2 does). A single string gives one row.
        Texts longer than the model's ``max_seq_len`` tokens are truncated, as
        sentence-transformers does. Texts from concurrent calls are batched
        together (see :class:`~asyncinfer.embedding.EmbeddingConfig`:
        ``max_batch_size``, ``max_wait_ms``). ``model``: the name of the
        embedding model (default: the first loaded). Cancelling the awaiting task
        drops the call's texts that are still queued.

        Raises:
            InvalidParameterError: bad ``texts`` or ``model`` (nothing was queued).
            RequestAbortedError: the call was aborted (remove_model or aclose with abort=True),
                or the encoder raised on its batch (the cause is chained; the engine keeps serving).
            EngineClosedError / EngineDeadError: the engine is not running.
        """
        self._check_running()
        entry = self._embedder(model)
        batch = _check_texts(texts)
        ids = entry.batcher.encoder.tokenize(batch)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()

        def on_done(call: EmbedCall) -> None:  # engine thread
            if call.error is not None:
                err = RequestAbortedError(f"the embedding batch failed: {call.error!r}")
                err.__cause__ = call.error
                self._call_on_loop(self._resolve_embed, call, err)
            else:
                self._call_on_loop(self._resolve_embed, call, call.stacked())

        call = EmbedCall(ids, time.monotonic(), on_done)
        entry.calls[call] = future
        self._embed_calls[call] = (entry, future)
        self._post("embed", (entry.batcher, call))
        try:
            return await future
        finally:
            # A caller that went away (its task cancelled, which cancels the future
            # too): the engine thread skips the call's texts still queued.
            call.cancelled = future.cancelled() or not future.done()
            self._forget_embed(call)

    def embedding_stats(self, model: str | None = None) -> EmbeddingStats:
        """What an embedding model's batcher did: calls, texts, batches and their sizes, tokens."""
        return self._embedder(model).batcher.stats()

    def _resolve_embed(self, call: EmbedCall, result: torch.Tensor | BaseException) -> None:
        item = self._embed_calls.get(call)
        if item is None or item[1].done():
            return
        if isinstance(result, BaseException):
            item[1].set_exception(result)
        else:
            item[1].set_result(result)

    def _forget_embed(self, call: EmbedCall) -> None:
        item = self._embed_calls.pop(call, None)
        if item is None:
            return
        entry = item[0]
        entry.calls.pop(call, None)
        if not entry.calls and entry.drained is not None and not entry.drained.done():
            entry.drained.set_result(None)

    def model_info(self) -> list[ModelVersionInfo]:
        """The live models and versions: name, kind, id, source, state, requests in flight, memory plan.

        Generators first, in load order (each with its live versions, oldest
        first), then embedding models. During an overlap swap the old version
        stays listed as ``"draining"`` until its last request has ended; a model
        being removed is listed as ``"draining"`` until it is gone.
        """
        infos: list[ModelVersionInfo] = []
        for name, holder in [*self._generators.items(), *self._removing.items()]:
            if isinstance(holder, ModelHolder):
                infos.extend(
                    self._info(v, name) for v in list(holder.live) if v.state is not VersionState.RETIRED
                )
        for name, entry in [*self._embedders.items(), *self._removing.items()]:
            if isinstance(entry, _EmbeddingModel):
                infos.append(self._embedder_info(entry))
        return infos

    def _info(self, version: ModelVersion, name: str = "default") -> ModelVersionInfo:
        in_flight = sum(1 for s in self._streams.values() if s.version_id == version.version_id)
        return ModelVersionInfo(
            version.version_id, version.source, version.state.value, in_flight, version.plan, name, "generate"
        )

    def _embedder_info(self, entry: _EmbeddingModel) -> ModelVersionInfo:
        state = "draining" if entry.name in self._removing else "current"
        return ModelVersionInfo(
            entry.version_id, entry.source, state, len(entry.calls), entry.batcher.plan, entry.name, "embed"
        )

    async def _admit(self, model: str | None) -> ModelVersion:
        """The version a new request to generator ``model`` is bound to; waits while a
        drain-mode swap has no version of it serving (requests wait, they do not fail)."""
        while True:
            self._check_running()
            holder = self._generator(model)
            if holder.current is not None:
                return holder.current
            await self._admission[holder].wait()

    def _check_swappable(self) -> None:
        if self._state is not EngineState.CREATED:
            self._check_running()

    def _fail_waiters(self, exc: BaseException) -> None:
        """Wake swaps waiting on an engine thread that is gone."""
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_exception(exc)

    async def _switch(self, version: ModelVersion, holder: ModelHolder) -> None:
        """Bind new requests to ``version`` and have the engine thread step it (at a step boundary)."""
        self._check_swappable()
        if self._state is EngineState.CREATED:  # no step loop yet: nothing can race with us
            holder.switch(version)
            holder.current = version
            holder.retire_idle()
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._waiters.add(done)
        # Requests posted from now on land in the inbox after the switch command.
        holder.current = version
        self._post("switch", (holder, version, lambda: done.done() or done.set_result(None)))
        try:
            await done
        finally:
            self._waiters.discard(done)

    async def _retire(self, version: ModelVersion, abort: bool, holder: ModelHolder) -> None:
        """Stop binding requests to ``version``, wait until its last one ends, drop it."""
        self._check_swappable()
        holder.current = None
        if self._state is EngineState.CREATED:
            holder.drain(version, abort=False)
            holder.retire_idle()
        else:
            loop = asyncio.get_running_loop()
            retired: asyncio.Future[None] = loop.create_future()
            self._waiters.add(retired)
            version.on_retired.append(lambda _v: self._call_on_loop(lambda: retired.done() or retired.set_result(None)))
            self._post("drain", (holder, version, abort))
            try:
                await retired
            finally:
                self._waiters.discard(retired)
        await anyio.to_thread.run_sync(gc.collect)  # free its tensors before the next load

    @property
    def kv_manager(self) -> KVCacheManager:
        return self._core.kv

    @property
    def core(self) -> EngineCore:
        """The current model version's synchronous core (for tests and benchmarks; do not step
        it while the engine runs)."""
        return self._core

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # --------------------------------------------------------------- requests
    def _check_running(self) -> None:
        if self._state is EngineState.DEAD:
            raise EngineDeadError("the engine's step loop failed") from self._dead_cause
        if self._state is not EngineState.RUNNING:
            raise EngineClosedError(
                f"the engine is {self._state.value}: use 'async with engine:' or 'await engine.start()'"
            )

    def _make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        version: ModelVersion,
    ) -> Request:
        self._check_running()
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidParameterError("params", params, "a SamplingParams instance or None")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidParameterError("priority", priority, "an integer")
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidParameterError("request_id", request_id, "a non-empty string")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidParameterError("cache_salt", cache_salt, "a string or None")
        if any(rid in self._ids_in_flight for rid in _sample_ids(request_id, params.n)):
            raise InvalidParameterError("request_id", request_id, "an id not used by a request in flight")
        prompt_ids = self._tokenize(prompt, version)
        max_model_len = version.max_model_len
        if len(prompt_ids) >= max_model_len:
            raise InvalidParameterError(
                "prompt", f"<{len(prompt_ids)} tokens>", f"at most max_model_len - 1 = {max_model_len - 1} tokens"
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            arrival_time=time.time(),
            priority=priority,
            cache_salt=cache_salt,
        )

    def _tokenize(self, prompt: Prompt, version: ModelVersion) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("prompt", prompt, "a non-empty string")
            ids = list(_need_tokenizer(version, "a text prompt").encode(prompt))
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = _chat_ids(version, prompt)  # type: ignore[arg-type]
        elif isinstance(prompt, Sequence) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)  # type: ignore[arg-type]
            vocab = version.model_config.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidParameterError("prompt", bad, f"token ids in [0, {vocab - 1}]")
        else:
            raise InvalidParameterError(
                "prompt", prompt, "a non-empty string, list of chat messages or list of token ids"
            )
        if not ids:
            raise InvalidParameterError("prompt", prompt, "a prompt of at least one token")
        return ids

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, model: str | None = None) -> list[int]:
        """Render chat messages with a generator's template (generation prompt added) into token ids."""
        return _chat_ids(_current(self._generator(model)), messages)

    async def _submit(self, request: Request, version: ModelVersion) -> AsyncIterator[CoreOutput]:
        """Hand a request to ``version``'s core and yield its outputs; abort it if the consumer goes away."""
        # No await separates this from _admit and _make_request, which bound the
        # request to ``version`` and tokenized and validated with it.
        stream = _Stream(request.params.n, _sample_ids(request.request_id, request.params.n), version.version_id)
        self._streams[request.request_id] = stream
        self._ids_in_flight.update(stream.ids)
        self._post("add", (version, request))
        done = 0
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    done += 1
                    stream.finished = done == stream.n
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self._forget(request.request_id)
                self.abort(request.request_id)

    def _forget(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._ids_in_flight.difference_update(stream.ids)

    # ------------------------------------------------------------ core thread
    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _run_core(self) -> None:
        holders = self._thread_holders
        stopping = False
        try:
            while True:
                self._wake.clear()
                outputs, stop = self._drain_inbox()
                stopping = stopping or stop
                if outputs:
                    self._deliver(outputs)
                for holder in holders:
                    holder.retire_idle()
                # At most one embedding batch per model between two generation steps.
                embed_wait = self._run_embedding_batches(flush=stopping)
                if not any(h.has_unfinished_requests() for h in holders):
                    if embed_wait is not None:  # texts wait for more to batch with
                        if embed_wait > 0:
                            self._wake.wait(embed_wait)
                        continue
                    if stopping:
                        self._call_on_loop(self._fail_waiters, EngineClosedError("the engine was closed"))
                        return
                    self._wake.wait()
                    continue
                outputs = []
                for holder in holders:
                    outputs.extend(holder.step())
                if outputs:
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("asyncinfer step loop failed")
            self._deliver_failure(exc)

    def _run_embedding_batches(self, *, flush: bool) -> float | None:
        """Run each embedding model's batch that is due (all that wait, when ``flush``);
        seconds until the next one is due, or None when no text waits."""
        soonest: float | None = None
        for batcher in list(self._thread_batchers):
            wait = batcher.wait_time()
            if wait is not None and (wait == 0 or flush):
                for call in batcher.run_batch():
                    call.on_done(call)
                wait = batcher.wait_time()
                if flush and wait is not None:
                    wait = 0.0
            if wait is None:
                self._thread_batchers.remove(batcher)
            elif soonest is None or wait < soonest:
                soonest = wait
        return soonest

    def _abort_embeds(self, batcher: EmbeddingBatcher, why: str) -> None:
        for call in batcher.take_all():
            self._call_on_loop(self._resolve_embed, call, RequestAbortedError(why))

    def _drain_inbox(self) -> tuple[list[CoreOutput], bool]:
        outputs: list[CoreOutput] = []
        stop = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs, stop
            holders = self._thread_holders
            if kind == "add":
                version, request = payload
                version.core.add_request(request)
            elif kind == "embed":
                batcher, call = payload
                if batcher not in self._thread_batchers:
                    self._thread_batchers.append(batcher)
                batcher.add(call)
            elif kind == "abort":
                for holder in holders:
                    outputs.extend(holder.abort(payload))
            elif kind == "abort_embeds":
                self._abort_embeds(payload, "the embedding model was removed with abort=True")
            elif kind == "reset_prefix_cache":
                for holder in holders:
                    holder.reset_prefix_cache()
            elif kind == "switch":
                holder, version, done = payload
                holder.switch(version)
                self._call_on_loop(done)
            elif kind == "drain":
                holder, version, abort = payload
                outputs.extend(holder.drain(version, abort=abort))
            elif kind == "add_holder":
                holders.append(payload)
            elif kind == "remove_holder":
                holders.remove(payload)
            elif kind == "stop":
                stop = True
                if payload:  # abort everything in flight
                    for holder in holders:
                        outputs.extend(holder.abort_all())
                    for batcher in self._thread_batchers:
                        self._abort_embeds(batcher, "the engine was closed with abort=True")

    def _call_on_loop(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver(self, outputs: list[CoreOutput]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason is not None:
                stream.num_done += 1
                if stream.num_done == stream.n:
                    self._forget(out.request_id)
            stream.queue.put_nowait(out)

    def _deliver_failure(self, exc: BaseException) -> None:
        def fail() -> None:
            self._state = EngineState.DEAD
            self._dead_cause = exc
            streams, self._streams = self._streams, {}
            self._ids_in_flight.clear()
            self._fail_waiters(EngineDeadError("the engine's step loop failed"))
            for _entry, future in list(self._embed_calls.values()):
                if not future.done():
                    err = EngineDeadError("the engine's step loop failed")
                    err.__cause__ = exc
                    future.set_exception(err)
            for stream in streams.values():
                err = EngineDeadError("the engine's step loop failed")
                err.__cause__ = exc
                stream.queue.put_nowait(err)

        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:
            pass


_M = TypeVar("_M")


def _pick(models: dict[str, _M], name: Any, kind: str, others: dict[str, Any], hint: str) -> _M:
    """``models[name]``, or the first loaded when ``name`` is None; a clear error otherwise."""
    if name is None:
        if not models:
            raise InvalidParameterError("model", None, f"a {kind}'s name, but this engine holds none (add_model)")
        return next(iter(models.values()))
    found = models.get(name) if isinstance(name, str) else None
    if found is None:
        extra = f" ({hint})" if isinstance(name, str) and name in others else ""
        raise InvalidParameterError("model", name, f"a loaded {kind}: {sorted(models)}{extra}")
    return found


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InvalidParameterError("name", name, "a non-empty string of at most 200 characters")


def _current(holder: ModelHolder) -> ModelVersion:
    """The version new requests to ``holder`` are bound to."""
    version = holder.current
    if version is None:
        raise EngineClosedError("no model version is serving (a drain-mode swap is loading the next one)")
    return version


def _need_tokenizer(version: ModelVersion, what: str) -> Any:
    if version.tokenizer is None:
        raise InvalidParameterError("prompt", what, "token ids: this model was loaded without a tokenizer")
    return version.tokenizer


def _chat_ids(version: ModelVersion, messages: Sequence[dict[str, str]]) -> list[int]:
    """Render chat messages with the version's template (generation prompt added) into token ids."""
    tokenizer = _need_tokenizer(version, "chat messages")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise InvalidParameterError(f"prompt[{i}]", message, "a dict with string 'role' and 'content'")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidParameterError("prompt", "chat messages", "text or token ids: this model has no chat template")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


MAX_EMBED_TEXTS = 65536


def _check_texts(texts: Any) -> list[str]:
    """``embed()``'s input as a list of strings (a single string is one text)."""
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence) or not texts or len(texts) > MAX_EMBED_TEXTS:
        raise InvalidParameterError("texts", texts, f"a string or a list of 1 to {MAX_EMBED_TEXTS} strings")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidParameterError(f"texts[{i}]", text, "a string")
    return list(texts)


def _sample_ids(request_id: str, n: int) -> tuple[str, ...]:
    """The core's ids of a request's samples: the request's own, then ``"<id>#<i>"`` (see ``core``)."""
    return (request_id, *(f"{request_id}#{i}" for i in range(1, n)))


def _build_core(loaded: LoadedModel, config: EngineConfig) -> tuple[MemoryPlan, EngineCore]:
    """Plan memory for a loaded model and wire its runner, KV cache, scheduler and sampler."""
    mc = loaded.config
    max_model_len = resolve_max_model_len(config, mc)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise InvalidParameterError(
            "max_num_batched_tokens",
            config.max_num_batched_tokens,
            f">= max_model_len ({max_model_len}) when enable_chunked_prefill=False",
        )
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    if config.quantization == "int8":
        weight_bytes = quantized_weight_bytes(loaded.model, config.quantization_skip)
    plan = plan_for_engine(config, mc, weight_bytes=weight_bytes, free_bytes=available_memory(config.device))
    logger.info("memory plan: %s", plan.describe())
    runner = ModelRunner(
        loaded.model,
        mc,
        num_blocks=plan.num_blocks,
        block_size=config.block_size,
        device=config.device,
        dtype=config.dtype,
    )
    kv = KVCacheManager(
        plan.num_blocks,
        config.block_size,
        watermark=config.kv_watermark,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
    )
    eos = default_eos_ids(mc.eos_token_ids, loaded.tokenizer)
    core = EngineCore(
        runner=runner,
        scheduler=create_scheduler(config.scheduler, scheduler_config, kv, config.scheduler_options),
        sampler=Sampler(mc.vocab_size, config.device, eos_token_ids=eos, seed=config.seed),
        tokenizer=loaded.tokenizer,
        eos_token_ids=eos,
        max_model_len=max_model_len,
    )
    return plan, core


def _make_version(
    version_id: int,
    loaded: LoadedModel,
    config: EngineConfig,
    options: dict[str, Any],
    plan: MemoryPlan,
    core: EngineCore,
) -> ModelVersion:
    return ModelVersion(
        version_id=version_id,
        source=loaded.source,
        path=loaded.source.split(":", 1)[1],
        config=config,
        options=options,
        model_config=loaded.config,
        tokenizer=loaded.tokenizer,
        plan=plan,
        core=core,
    )


def _check_fit(
    model: str | os.PathLike[str] | None,
    options: dict[str, Any],
    available: int | None,
    beside: str,
    error: type[ModelLoadError] = SwapError,
) -> str | None:
    """Why the new generator cannot be placed beside ``beside``, or None when it fits.

    Reads only the new model's config, so a missing or unreadable model fails
    here, before anything is drained or loaded.
    """
    config = EngineConfig.from_options(options)
    try:
        path = resolve_model(model)
        avail = available_memory(config.device) if available is None else available
        plan = plan_memory(path, available_bytes=avail, **options)
    except ConfigurationError as exc:
        return f"the new model does not fit beside {beside}: {exc}"
    except ModelLoadError as exc:
        raise error(f"cannot load {model!r}: {exc}; the serving models are untouched") from exc
    need = plan.weight_bytes + plan.kv_bytes + plan.activation_reserve
    if need > avail:
        return (
            f"the new model does not fit beside {beside}: weights {plan.weight_bytes / MiB:.1f} MiB"
            f" + KV cache {plan.kv_bytes / MiB:.1f} MiB + activation reserve {plan.activation_reserve / MiB:.1f} MiB"
            f" = {need / MiB:.1f} MiB, but {avail / MiB:.1f} MiB are available now."
        )
    return None


def _check_embedder_fit(path: os.PathLike[str], config: EmbeddingConfig, available: int | None) -> str | None:
    """Why the embedding model cannot be placed beside the loaded models, or None when it fits
    (reads only its config)."""
    return _embedder_shortfall(plan_embedding(read_encoder_config(path), config), config, available)


def _embedder_shortfall(plan: EmbeddingPlan, config: EmbeddingConfig, available: int | None) -> str | None:
    avail = available_memory(config.device) if available is None else available
    if plan.total_bytes > avail:
        return (
            f"the embedding model does not fit beside the loaded models: {plan.describe()}"
            f" = {plan.total_bytes / MiB:.1f} MiB, but {avail / MiB:.1f} MiB are available now."
        )
    return None


def _load_embedder(
    path: os.PathLike[str], config: EmbeddingConfig, error: type[ModelLoadError], what: str
) -> EmbeddingBatcher:
    """Load, check and warm up an embedding model (in a worker thread; nothing shared is touched)."""
    try:
        encoder = load_encoder(path, config.dtype, config.device)
        encoder.config = apply_max_seq_len(encoder.config, config)
        encoder.encode(["warm-up"])
    except InvalidParameterError:
        raise
    except Exception as exc:
        raise error(f"{what} failed: {exc}") from exc
    return EmbeddingBatcher(encoder, config)


def _load_version(
    model: str | os.PathLike[str] | None,
    config: EngineConfig,
    options: dict[str, Any],
    version_id: int,
    error: type[ModelLoadError] = SwapError,
    what: str | None = None,
) -> ModelVersion:
    """Load, check and warm up a model version (in a worker thread; nothing shared is touched)."""
    try:
        loaded = load_model(resolve_model(model), config.dtype, config.device)
        _check_tokenizer(loaded)
        plan, core = _build_core(loaded, config)
        _warm_up(core)
    except (InvalidParameterError, ConfigurationError):
        raise
    except Exception as exc:
        what = what or f"loading {model!r} as a new model version"
        raise error(f"{what} failed: {exc}") from exc
    return _make_version(version_id, loaded, config, options, plan, core)


def _check_tokenizer(loaded: LoadedModel) -> None:
    """Reject a tokenizer that produces ids the model has no embedding for."""
    tokenizer = loaded.tokenizer
    if tokenizer is not None and len(tokenizer) > loaded.config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {loaded.config.vocab_size}"
        )


def _warm_up(core: EngineCore) -> None:
    """Run one tiny greedy request through a fresh core, then clear what it left behind."""
    request = Request("warm-up", [0], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=time.time())
    core.add_request(request)
    while core.has_unfinished_requests():
        core.step()
    core.reset_prefix_cache()
    core.stats = StepStats()
    core.kv.num_prefix_queries = core.kv.num_prefix_hits = 0
