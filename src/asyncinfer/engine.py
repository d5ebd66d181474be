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
from typing import Any

import anyio
import torch

from asyncinfer.cache.kv_manager import KVCacheManager, KVCacheStats
from asyncinfer.config import EngineConfig
from asyncinfer.core import CoreOutput, EngineCore, StepStats, default_eos_ids
from asyncinfer.errors import (
    ConfigurationError,
    EngineClosedError,
    EngineDeadError,
    InvalidParameterError,
    ModelLoadError,
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


class AsyncEngine:
    """An in-process LLM engine: ``async with AsyncEngine.from_pretrained() as engine``.

    Build it with :meth:`from_pretrained`; start it with ``async with`` (or
    :meth:`start`); use :meth:`generate` and :meth:`stream` from any task.
    """

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        config: EngineConfig,
        plan: MemoryPlan,
        core: EngineCore,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self._holder = ModelHolder(_make_version(0, loaded, config, dict(options or {}), plan, core))
        self._swap_lock = asyncio.Lock()  # one swap at a time
        self._waiters: set[asyncio.Future[None]] = set()  # swaps waiting on the engine thread
        self._admission = asyncio.Event()  # cleared while a drain-mode swap has no version serving
        self._admission.set()
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
    def from_pretrained(cls, model: str | os.PathLike[str] | None = None, **options: Any) -> AsyncEngine:
        """Load a model and plan memory; the engine starts on ``async with`` / :meth:`start`.

        ``model``: a Hugging Face model directory (config.json + safetensors), a
        ``.gguf`` file, or ``None`` for the default model (SmolLM2-135M-Instruct).
        ``options``: the fields of :class:`~asyncinfer.config.EngineConfig`; an
        unknown one raises :class:`InvalidParameterError`.

        Raises:
            InvalidParameterError: an unknown option or an out-of-range value.
            ModelLoadError: the model cannot be found or loaded.
            ConfigurationError: the KV cache cannot hold one ``max_model_len`` request.
        """
        config = EngineConfig.from_options(options)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(resolve_model(model), config.dtype, config.device)
        plan, core = _build_core(loaded, config)
        return cls(loaded=loaded, config=config, plan=plan, core=core, options=options)

    @classmethod
    def plan_memory(
        cls, model: str | os.PathLike[str] | None = None, *, available_bytes: int | None = None, **options: Any
    ) -> MemoryPlan:
        """The memory plan :meth:`from_pretrained` would make, computed before loading any weight.

        Reads only the model's config (config.json or the GGUF header) and
        estimates the weights from its shapes in the chosen dtype. Takes the
        same options as :meth:`from_pretrained`; ``available_bytes`` overrides
        the memory measured as free now (before loading).

        Raises:
            InvalidParameterError: an unknown option or an out-of-range value.
            ModelLoadError: the model's config cannot be read.
            ConfigurationError: the KV cache cannot hold one ``max_model_len`` request.
        """
        return plan_memory(model, available_bytes=available_bytes, **options)

    # --------------------------------------------------------------- lifecycle
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def max_model_len(self) -> int:
        return self._version.max_model_len

    @property
    def _version(self) -> ModelVersion:
        """The version new requests are bound to."""
        version = self._holder.current
        if version is None:
            raise EngineClosedError("no model version is serving (a drain-mode swap is loading the next one)")
        return version

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
            self._admission.set()  # requests waiting on a drain-mode swap now see the engine closing
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
    ) -> RequestOutput:
        """Run one request to its end and return the whole result.

        With ``params.n > 1`` the result's ``outputs`` holds every sample (its
        flat fields are sample 0's). ``cache_salt``: requests share cached prompt
        prefixes only with requests of the same salt (e.g. one per tenant).

        Cancelling the awaiting task aborts the request (its KV blocks return at
        the next step boundary). A request aborted with :meth:`abort` returns
        with ``finish_reason == "abort"``.

        Raises:
            InvalidParameterError: bad prompt or parameters (nothing was queued).
            EngineClosedError: the engine is not running.
            EngineDeadError: the step loop failed.
        """
        await self._wait_for_admission()
        request = self._make_request(prompt, params, request_id, priority, cache_salt)
        n = request.params.n
        want_logprobs = request.params.logprobs is not None
        token_ids: list[list[int]] = [[] for _ in range(n)]
        pieces: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[Logprob]] = [[] for _ in range(n)]
        last: list[CoreOutput | None] = [None] * n
        async for out in self._submit(request):
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
    ) -> AsyncIterator[StreamDelta]:
        """Yield :class:`StreamDelta` pieces as tokens are generated; the last has ``finish_reason``.

        With ``params.n > 1`` the samples' deltas interleave, told apart by
        ``delta.index``; each sample's last delta has ``finish_reason`` and the
        stream ends after all ``n`` have finished.
        Breaking out of the loop or cancelling the consuming task aborts the request.
        Raises the same errors as :meth:`generate`, before the first delta.
        """
        await self._wait_for_admission()
        request = self._make_request(prompt, params, request_id, priority, cache_salt)
        async for out in self._submit(request):
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

    def kv_stats(self) -> KVCacheStats:
        """A snapshot of the KV cache figures: blocks used/free/cached-free, usage, waste,
        prefix-cache queries and hits (tokens), copy-on-write copies, evictions, preemptions.

        Read while the engine runs it is a snapshot taken between two steps at best
        (the numbers are plain ints; a torn read is off by one step, never corrupt).
        """
        return self._core.kv.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, at the next step boundary.

        Requests submitted after this call never reuse blocks cached before it;
        requests in flight keep the blocks they hold but add nothing to the new cache.
        """
        if self._state in (EngineState.RUNNING, EngineState.CLOSING):
            self._post("reset_prefix_cache", None)
        else:  # no step loop is running: nothing can race with it
            self._core.reset_prefix_cache()

    # ------------------------------------------------------------- model swaps
    async def swap_model(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        mode: str = "overlap",
        abort: bool = False,
        available_bytes: int | None = None,
        **options: Any,
    ) -> ModelVersionInfo:
        """Replace the served model; returns once the new version takes requests.

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
            InvalidParameterError: a bad ``mode`` or option; nothing was loaded.
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
            old = self._version
            merged = {**old.options, **options}
            config = EngineConfig.from_options(merged)
            shortfall = await anyio.to_thread.run_sync(_check_fit, model, merged, available_bytes)
            if shortfall is not None and mode == "overlap":
                raise ConfigurationError(shortfall)
            if mode == "overlap":
                new = await anyio.to_thread.run_sync(_load_version, model, config, merged, self._holder.next_id())
                await self._switch(new)
                return self._info(new)
            self._admission.clear()
            try:
                await self._retire(old, abort)
                try:
                    new = await anyio.to_thread.run_sync(
                        _load_version, model, config, merged, self._holder.next_id()
                    )
                except BaseException:
                    # The old version is gone already: bring it back so the engine keeps serving.
                    back = await anyio.to_thread.run_sync(
                        _load_version, old.path, old.config, old.options, self._holder.next_id()
                    )
                    await self._switch(back)
                    raise
                await self._switch(new)
                return self._info(new)
            finally:
                self._admission.set()

    def model_info(self) -> list[ModelVersionInfo]:
        """The live model versions, oldest first: id, source, state, requests in flight, memory plan.

        One entry normally; during an overlap swap the old version stays listed
        as ``"draining"`` until its last request has ended.
        """
        return [self._info(v) for v in list(self._holder.live) if v.state is not VersionState.RETIRED]

    def _info(self, version: ModelVersion) -> ModelVersionInfo:
        in_flight = sum(1 for s in self._streams.values() if s.version_id == version.version_id)
        return ModelVersionInfo(version.version_id, version.source, version.state.value, in_flight, version.plan)

    async def _wait_for_admission(self) -> None:
        """Wait while a drain-mode swap has no version serving (requests wait, they do not fail)."""
        while not self._admission.is_set():
            await self._admission.wait()

    def _check_swappable(self) -> None:
        if self._state is not EngineState.CREATED:
            self._check_running()

    def _fail_waiters(self, exc: BaseException) -> None:
        """Wake swaps waiting on an engine thread that is gone."""
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_exception(exc)

    async def _switch(self, version: ModelVersion) -> None:
        """Bind new requests to ``version`` and have the engine thread step it (at a step boundary)."""
        self._check_swappable()
        if self._state is EngineState.CREATED:  # no step loop yet: nothing can race with us
            self._holder.switch(version)
            self._holder.current = version
            self._holder.retire_idle()
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._waiters.add(done)
        # Requests posted from now on land in the inbox after the switch command.
        self._holder.current = version
        self._post("switch", (version, lambda: done.done() or done.set_result(None)))
        try:
            await done
        finally:
            self._waiters.discard(done)

    async def _retire(self, version: ModelVersion, abort: bool) -> None:
        """Stop binding requests to ``version``, wait until its last one ends, drop it."""
        self._check_swappable()
        self._holder.current = None
        if self._state is EngineState.CREATED:
            self._holder.drain(version, abort=False)
            self._holder.retire_idle()
        else:
            loop = asyncio.get_running_loop()
            retired: asyncio.Future[None] = loop.create_future()
            self._waiters.add(retired)
            version.on_retired.append(lambda _v: self._call_on_loop(lambda: retired.done() or retired.set_result(None)))
            self._post("drain", (version, abort))
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
        cache_salt: str | None = None,
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
        prompt_ids = self._tokenize(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidParameterError(
                "prompt", f"<{len(prompt_ids)} tokens>", f"at most max_model_len - 1 = {self.max_model_len - 1} tokens"
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            arrival_time=time.time(),
            priority=priority,
            cache_salt=cache_salt,
        )

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("prompt", prompt, "a non-empty string")
            ids = list(self._need_tokenizer("a text prompt").encode(prompt))
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.apply_chat_template(prompt)  # type: ignore[arg-type]
        elif isinstance(prompt, Sequence) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)  # type: ignore[arg-type]
            vocab = self.model_config.vocab_size
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

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Render chat messages with the model's template (generation prompt added) into token ids."""
        tokenizer = self._need_tokenizer("chat messages")
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise InvalidParameterError(f"prompt[{i}]", message, "a dict with string 'role' and 'content'")
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidParameterError("prompt", "chat messages", "text or token ids: this model has no chat template")
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise InvalidParameterError("prompt", what, "token ids: this model was loaded without a tokenizer")
        return self.tokenizer

    async def _submit(self, request: Request) -> AsyncIterator[CoreOutput]:
        """Hand a request to the core and yield its outputs; abort it if the consumer goes away."""
        # Bound to the version current now: no await separates this from
        # _make_request, which tokenized and validated with that version.
        version = self._version
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
        holder = self._holder
        stopping = False
        try:
            while True:
                self._wake.clear()
                outputs, stop = self._drain_inbox()
                stopping = stopping or stop
                if outputs:
                    self._deliver(outputs)
                holder.retire_idle()
                if not holder.has_unfinished_requests():
                    if stopping:
                        self._call_on_loop(self._fail_waiters, EngineClosedError("the engine was closed"))
                        return
                    self._wake.wait()
                    continue
                outputs = holder.step()
                if outputs:
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("asyncinfer step loop failed")
            self._deliver_failure(exc)

    def _drain_inbox(self) -> tuple[list[CoreOutput], bool]:
        outputs: list[CoreOutput] = []
        stop = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs, stop
            if kind == "add":
                version, request = payload
                version.core.add_request(request)
            elif kind == "abort":
                outputs.extend(self._holder.abort(payload))
            elif kind == "reset_prefix_cache":
                self._holder.reset_prefix_cache()
            elif kind == "switch":
                version, done = payload
                self._holder.switch(version)
                self._call_on_loop(done)
            elif kind == "drain":
                version, abort = payload
                outputs.extend(self._holder.drain(version, abort=abort))
            elif kind == "stop":
                stop = True
                if payload:  # abort everything in flight
                    outputs.extend(self._holder.abort_all())

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
            for stream in streams.values():
                err = EngineDeadError("the engine's step loop failed")
                err.__cause__ = exc
                stream.queue.put_nowait(err)

        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:
            pass


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


def _check_fit(model: str | os.PathLike[str] | None, options: dict[str, Any], available: int | None) -> str | None:
    """Why the new version cannot be placed beside the serving one, or None when it fits.

    Reads only the new model's config, so a missing or unreadable model fails
    here, before anything is drained or loaded.
    """
    config = EngineConfig.from_options(options)
    try:
        path = resolve_model(model)
        avail = available_memory(config.device) if available is None else available
        plan = plan_memory(path, available_bytes=avail, **options)
    except ConfigurationError as exc:
        return f"the new model version does not fit beside the serving one: {exc}"
    except ModelLoadError as exc:
        raise SwapError(f"cannot swap to {model!r}: {exc}; the serving version is untouched") from exc
    need = plan.weight_bytes + plan.kv_bytes + plan.activation_reserve
    if need > avail:
        return (
            f"the new model version does not fit beside the serving one: weights {plan.weight_bytes / MiB:.1f} MiB"
            f" + KV cache {plan.kv_bytes / MiB:.1f} MiB + activation reserve {plan.activation_reserve / MiB:.1f} MiB"
            f" = {need / MiB:.1f} MiB, but {avail / MiB:.1f} MiB are available now. Swap with mode='drain', or"
            " lower kv_cache_memory / kv_cache_fraction / max_model_len."
        )
    return None


def _load_version(
    model: str | os.PathLike[str] | None, config: EngineConfig, options: dict[str, Any], version_id: int
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
        raise SwapError(f"loading {model!r} as a new model version failed: {exc}") from exc
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
