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
from asyncinfer.core import CoreOutput, EngineCore, default_eos_ids
from asyncinfer.errors import EngineClosedError, EngineDeadError, InvalidParameterError
from asyncinfer.memory import MemoryPlan, available_memory, plan_for_engine, plan_memory, resolve_max_model_len
from asyncinfer.model_source import resolve_model
from asyncinfer.models import LoadedModel, load_model
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

    __slots__ = ("queue", "finished", "n", "num_done", "ids")

    def __init__(self, n: int, ids: tuple[str, ...]) -> None:
        self.queue: asyncio.Queue[CoreOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.n = n
        self.num_done = 0  # samples whose last output was delivered to the queue
        self.ids = ids  # the core's request ids of the samples


class AsyncEngine:
    """An in-process LLM engine: ``async with AsyncEngine.from_pretrained() as engine``.

    Build it with :meth:`from_pretrained`; start it with ``async with`` (or
    :meth:`start`); use :meth:`generate` and :meth:`stream` from any task.
    """

    def __init__(self, *, loaded: LoadedModel, config: EngineConfig, plan: MemoryPlan, core: EngineCore) -> None:
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        self.memory_plan = plan
        self._core = core
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
        return cls(loaded=loaded, config=config, plan=plan, core=core)

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
        return self._core.max_model_len

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

    @property
    def kv_manager(self) -> KVCacheManager:
        return self._core.kv

    @property
    def core(self) -> EngineCore:
        """The synchronous core (for tests and benchmarks; do not step it while the engine runs)."""
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
        stream = _Stream(request.params.n, _sample_ids(request.request_id, request.params.n))
        self._streams[request.request_id] = stream
        self._ids_in_flight.update(stream.ids)
        self._post("add", request)
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
        core = self._core
        stopping = False
        try:
            while True:
                self._wake.clear()
                outputs, stop = self._drain_inbox()
                stopping = stopping or stop
                if outputs:
                    self._deliver(outputs)
                if not core.has_unfinished_requests():
                    if stopping:
                        return
                    self._wake.wait()
                    continue
                outputs = core.step()
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
                self._core.add_request(payload)
            elif kind == "abort":
                outputs.extend(self._core.abort_request(payload))
            elif kind == "reset_prefix_cache":
                self._core.reset_prefix_cache()
            elif kind == "stop":
                stop = True
                if payload:  # abort everything in flight
                    outputs.extend(self._core.abort_all())

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
