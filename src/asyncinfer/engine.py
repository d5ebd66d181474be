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
from asyncinfer.memory import MemoryPlan, available_memory, plan_kv_cache
from asyncinfer.model_source import resolve_model
from asyncinfer.models import LoadedModel, load_model
from asyncinfer.outputs import Logprob, RequestMetrics, RequestOutput, StreamDelta
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
    """One request's output queue on the event loop side."""

    __slots__ = ("queue", "finished")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[CoreOutput | BaseException] = asyncio.Queue()
        self.finished = False


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
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise InvalidParameterError(
                "max_model_len", max_model_len, f"at most the model's context length {mc.max_position_embeddings}"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                config.max_num_batched_tokens,
                f">= max_model_len ({max_model_len}) when enable_chunked_prefill=False",
            )
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        plan = plan_kv_cache(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype_bytes=config.dtype_bytes,
            block_size=config.block_size,
            max_model_len=max_model_len,
            weight_bytes=weight_bytes,
            kv_cache_memory=config.kv_cache_memory,
            kv_cache_fraction=config.kv_cache_fraction,
            activation_reserve=config.activation_reserve,
            free_bytes=available_memory(config.device),
        )
        logger.info("memory plan: %s", plan.describe())
        runner = ModelRunner(
            loaded.model,
            mc,
            num_blocks=plan.num_blocks,
            block_size=config.block_size,
            device=config.device,
            dtype=config.dtype,
        )
        kv = KVCacheManager(plan.num_blocks, config.block_size)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        eos = default_eos_ids(mc.eos_token_ids, loaded.tokenizer)
        core = EngineCore(
            runner=runner,
            scheduler=create_scheduler(config.scheduler, scheduler_config, kv),
            sampler=Sampler(mc.vocab_size, config.device, eos_token_ids=eos, seed=config.seed),
            tokenizer=loaded.tokenizer,
            eos_token_ids=eos,
            max_model_len=max_model_len,
        )
        return cls(loaded=loaded, config=config, plan=plan, core=core)

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
    ) -> RequestOutput:
        """Run one request to its end and return the whole result.

        Cancelling the awaiting task aborts the request (its KV blocks return at
        the next step boundary). A request aborted with :meth:`abort` returns
        with ``finish_reason == "abort"``.

        Raises:
            InvalidParameterError: bad prompt or parameters (nothing was queued).
            EngineClosedError: the engine is not running.
            EngineDeadError: the step loop failed.
        """
        request = self._make_request(prompt, params, request_id, priority)
        token_ids: list[int] = []
        pieces: list[str] = []
        logprobs: list[Logprob] | None = [] if request.params.logprobs is not None else None
        last: CoreOutput | None = None
        async for out in self._submit(request):
            token_ids.extend(out.token_ids)
            pieces.append(out.text)
            if logprobs is not None and out.logprobs:
                logprobs.extend(out.logprobs)
            last = out
        assert last is not None and last.finish_reason is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=token_ids,
            text="".join(pieces),
            finish_reason=last.finish_reason,  # type: ignore[arg-type]
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_token_time=last.first_token_time,
                finish_time=last.finish_time,
                num_preemptions=last.num_preemptions,
            ),
            logprobs=logprobs,
            stop_reason=last.stop_reason,
        )

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """Yield :class:`StreamDelta` pieces as tokens are generated; the last has ``finish_reason``.

        Breaking out of the loop or cancelling the consuming task aborts the request.
        Raises the same errors as :meth:`generate`, before the first delta.
        """
        request = self._make_request(prompt, params, request_id, priority)
        async for out in self._submit(request):
            yield StreamDelta(
                request_id=out.request_id,
                text=out.text,
                token_ids=out.token_ids,
                finish_reason=out.finish_reason,  # type: ignore[arg-type]
                logprobs=out.logprobs,
            )

    def abort(self, request_id: str) -> None:
        """Abort a request by id at the next step boundary (unknown or finished ids are ignored)."""
        if self._state in (EngineState.RUNNING, EngineState.CLOSING):
            self._post("abort", request_id)

    def kv_stats(self) -> KVCacheStats:
        """A snapshot of the KV cache figures (blocks used/free, usage, waste, preemptions)."""
        return self._core.kv.stats()

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
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, priority: int
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
        elif request_id in self._streams:
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
        stream = _Stream()
        self._streams[request.request_id] = stream
        self._post("add", request)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self._streams.pop(request.request_id, None)
                self.abort(request.request_id)

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
                out = self._core.abort_request(payload)
                if out is not None:
                    outputs.append(out)
            elif kind == "stop":
                stop = True
                if payload:  # abort everything in flight
                    for request_id in list(self._core.scheduler.requests):
                        out = self._core.abort_request(request_id)
                        if out is not None:
                            outputs.append(out)

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
                del self._streams[out.request_id]
            stream.queue.put_nowait(out)

    def _deliver_failure(self, exc: BaseException) -> None:
        def fail() -> None:
            self._state = EngineState.DEAD
            self._dead_cause = exc
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                err = EngineDeadError("the engine's step loop failed")
                err.__cause__ = exc
                stream.queue.put_nowait(err)

        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:
            pass
