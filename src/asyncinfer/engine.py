"""AsyncEngine: the public, asyncio face of the engine.

The application's event loop only validates, tokenizes and waits. All model
work runs on one engine thread (``engine_thread.py``), which takes typed
commands in and hands results back through one path into per-request queues
(``streams.py``). Loading lives in ``loading.py``, the named models in
``catalog.py``, prompt handling in ``prompts.py``, output assembly in
``outputs.py``. The engine holds no process-global state: several engines can
live in one process (one per Ray Serve replica, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import torch

from asyncinfer.cache.kv_manager import KVCacheManager, KVCacheStats
from asyncinfer.catalog import EmbedCalls, EmbeddingModel, ModelCatalog, check_name, current
from asyncinfer.config import EngineConfig, check_int
from asyncinfer.core import EngineCore, StepStats
from asyncinfer.embedding import EmbeddingBatcher, EmbeddingPlan, EmbeddingStats
from asyncinfer.engine_thread import (
    AbortRequest,
    AddRequest,
    Command,
    EngineThread,
    LoopCallbacks,
    ResetPrefixCache,
    Stop,
    ThreadLink,
)
from asyncinfer.errors import EngineClosedError, EngineDeadError, InvalidParameterError, WrongEventLoopError
from asyncinfer.holder import ModelHolder, ModelVersion, ModelVersionInfo
from asyncinfer.intake import AbortedWhileWaiting, RequestArgs, RequestIntake
from asyncinfer.loading import ModelRef, load, plan_model_memory
from asyncinfer.memory import MemoryPlan
from asyncinfer.metrics import EngineMetrics, MemoryReport, ProfileResult
from asyncinfer.metrics.memory_report import memory_report
from asyncinfer.metrics.profile import profile_steps
from asyncinfer.models import ModelConfig
from asyncinfer.outputs import CoreOutput, OutputAssembler, RequestOutput, StreamDelta, stream_delta
from asyncinfer.plain import plain_value
from asyncinfer.prompts import (
    LoopShare,
    Prompt,
    chat_token_ids,
    check_prompt_chars,
    check_request_args,
    check_request_id,
    check_tenant,
    check_text_prompt,
    check_texts,
    plain_prompt,
    prompt_kind,
    prompt_token_ids,
)
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.streams import RequestStream, StreamTable
from asyncinfer.swaps import ModelChanges
from asyncinfer.threads import WorkShares

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Self  # typing.Self from Python 3.11 on

__all__ = ["AsyncEngine", "EngineState", "Prompt"]


#: Why an engine cannot start (or be called) where no asyncio loop runs.
_NO_ASYNCIO_LOOP = ("the engine runs on asyncio only, and no asyncio event loop runs here (trio, or anyio's trio "
                    "backend?): run it on an asyncio loop in a thread of its own (docs/guides/trio.md)")
#: What a closed engine's errors suggest: it never runs again (its thread and loop are gone), a new one does.
_LOAD_ANOTHER = "load a new engine (await AsyncEngine.load(...) or AsyncEngine.from_pretrained(...))"


class EngineState(enum.Enum):
    """The engine's lifecycle (``engine.state``); ``DEAD`` means the step loop broke."""

    CREATED = "created"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    DEAD = "dead"


class _Binding:
    """One generate() / stream() call while its request is bound (``AsyncEngine._bind``): whether
    :meth:`AsyncEngine.abort` named its id meanwhile."""

    __slots__ = ("aborted",)

    def __init__(self) -> None:
        self.aborted = False


def _aborted_output(request_id: str, index: int) -> CoreOutput:
    """The end of a sample whose request was aborted before it was bound (nothing generated)."""
    return CoreOutput(request_id, [], "", finish_reason="abort", finish_time=time.time(), index=index)


def _aborted_unbound(args: RequestArgs) -> OutputAssembler:
    """The result of a request aborted while it waited its turn: its prompt's ids if they were made at the call
    (else none: its prompt was never made), every sample ended as an abort with nothing generated."""
    ids = list(args.early[1]) if args.early is not None else []
    result = OutputAssembler(args.request_id, ids, time.time(), args.params.n, args.params.logprobs is not None)
    for i in range(args.params.n):
        result.add(_aborted_output(args.request_id, i))
    return result


class AsyncEngine:
    """An in-process LLM engine: ``async with AsyncEngine.from_pretrained() as engine``.

    Build it with :meth:`from_pretrained`; start it with ``async with`` (or
    :meth:`start`); use :meth:`generate` and :meth:`stream` from any task.
    One engine can hold several named models (:meth:`add_model`), generators
    and embedding models (:meth:`embed`); ``model=`` picks one, the first
    loaded of each kind is the default.
    """

    def __init__(self, *args: object, config: EngineConfig | None = None, name: str = "default",
                 version: ModelVersion | None = None, embedder: EmbeddingBatcher | None = None) -> None:
        if args or config is None:  # AsyncEngine("model") / AsyncEngine(): Python's message named only 'config'
            raise TypeError("an AsyncEngine is built by AsyncEngine.from_pretrained(model, **options) or, in a "
                            "coroutine, 'await AsyncEngine.load(model, **options)', not by AsyncEngine(...)")
        self._config = config  # the first load's options (of an embedding-only engine: its dtype, device, threads)
        self._version_ids = itertools.count(1 if version is None else version.version_id + 1)
        loop_share = LoopShare()  # what this engine tokenizes on the loop in one turn of it, prompts and texts
        work_shares = WorkShares()  # and the worker threads of what it tokenizes off the loop, by tenant
        self._models = ModelCatalog(loop_share, work_shares)
        if version is not None:
            self._models.add_generator(name, ModelHolder(version))
        if embedder is not None:
            self._models.add_embedder(EmbeddingModel(name, next(self._version_ids), embedder))
        self._state = EngineState.CREATED
        self._dead_cause: BaseException | None = None
        generators = [(n, h.current) for n, h in self._models.generators.items() if h.current is not None]
        # engine.metrics observes: the engine hands each part that feeds it its observer.
        self.metrics = EngineMetrics(self, config, generators)
        self._streams = StreamTable(observer=self.metrics)
        self._embed_calls = EmbedCalls(loop_share, work_shares)
        self._link = ThreadLink()
        self._changes = ModelChanges(self._models, self._link, self._version_ids, self._check_usable, config.device,
                                     observer=self.metrics)
        self._intake = RequestIntake(self._models, self._streams, observer=self.metrics)
        self._binding: dict[str, list[_Binding]] = {}  # calls being bound, by request id (abort() marks them)

    # ---------------------------------------------------------------- building
    @classmethod
    def from_pretrained(cls, model: ModelRef = None, *, name: str = "default", **options: Any) -> AsyncEngine:
        """Load a model and plan memory; the engine starts on ``async with`` / :meth:`start`.

        ``model``: a Hugging Face directory (config.json + safetensors), a ``.gguf`` file, a known
        name ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"), or ``None`` (SmolLM2-135M-Instruct).
        A BERT-family sentence encoder makes an embedding-only engine (:meth:`embed`).
        ``name``: the model's name for ``model=`` (more models: :meth:`add_model`).
        ``options``: the fields of :class:`~asyncinfer.config.EngineConfig`
        (:class:`~asyncinfer.embedding.EmbeddingConfig` for an embedding model);
        an unknown one raises :class:`InvalidParameterError`.

        Raises:
            InvalidParameterError: an unknown option or an out-of-range value.
            ModelLoadError: the model cannot be found or loaded.
            ConfigurationError: the weights, or one ``max_model_len`` request's KV cache, do not
                fit (checked from the config, before any weight is read).
        """
        name = check_name(name)
        loaded = load(model, options, version_id=0)
        if isinstance(loaded, EmbeddingBatcher):
            ec = loaded.config
            return cls(config=EngineConfig(dtype=ec.dtype, device=ec.device, num_threads=ec.num_threads),
                       name=name, embedder=loaded)
        return cls(config=loaded.config, name=name, version=loaded)

    @classmethod
    async def load(cls, model: ModelRef = None, *, name: str = "default", **options: Any) -> AsyncEngine:
        """:meth:`from_pretrained` in a worker thread: the event loop keeps running during the load.

        For a FastAPI lifespan or a bot's ``setup_hook`` (heartbeats keep flowing). Same
        arguments and errors; a cancelled caller waits for the load to end, then drops it.
        """
        return await anyio.to_thread.run_sync(functools.partial(cls.from_pretrained, model, name=name, **options))

    @classmethod
    def plan_memory(
        cls, model: ModelRef | ModelConfig = None, *, available_bytes: int | None = None, **options: Any
    ) -> MemoryPlan | EmbeddingPlan:
        """The memory plan :meth:`from_pretrained` would make, computed before loading any weight.

        Reads only the model's config (config.json or the GGUF header); the
        weights are computed from its shapes, dtype and weight format. Same options as
        :meth:`from_pretrained`; ``available_bytes`` overrides the memory free now. An
        embedding model gives an :class:`EmbeddingPlan` (weights + largest batch's activations).

        Raises:
            InvalidParameterError: an unknown option or an out-of-range value (``available_bytes``: an ``int`` in [0, 2**63 - 1]
                or None, as ``swap_model`` and ``add_model`` take it).
            ModelLoadError: the model's config cannot be read.
            ConfigurationError: the KV cache cannot hold one ``max_model_len`` request.
        """
        return plan_model_memory(model, available_bytes=available_bytes, **options)

    # --------------------------------------------------------------- lifecycle
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def _version(self) -> ModelVersion:  # the default generator's current version
        return current(self._models.generator(None))

    @property
    def config(self) -> EngineConfig:
        """The options of the default generator's serving version, as :meth:`swap_model` last set them (the options
        it was not given carry over); an engine without a generator: the options it was built with."""
        if not self._models.generators:
            return self._config
        return self._models.generator(None).config

    @property
    def max_model_len(self) -> int:
        return self._version.max_model_len

    @property
    def model_config(self) -> ModelConfig:
        """The default generator's current model config."""
        return self._version.model_config

    @property
    def tokenizer(self) -> Any:
        """The default generator's tokenizer (None for a model without tokenizer files)."""
        return self._version.tokenizer

    def get_tokenizer(self, model: str | None = None) -> Any:
        """The tokenizer of the model named ``model``, generator or embedding model (None: default generator)."""
        return self._models.tokenizer_of(model)

    @property
    def model_source(self) -> str:  # "gguf:<file>" or "safetensors:<dir>"
        return self._version.source

    @property
    def memory_plan(self) -> MemoryPlan:  # the default generator's
        return self._version.plan

    @property
    def core(self) -> EngineCore:
        """The default generator's synchronous core (for benchmarks; do not step it while the engine runs)."""
        core = self._version.core
        assert core is not None
        return core

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.core.kv

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine was started on (None before :meth:`start`); call it from there."""
        return None if self._link.thread is None else self._link.thread.loop

    @property
    def num_unfinished_requests(self) -> int:
        """Requests handed to the engine thread and not yet finished, of every generator (a request of
        ``n`` samples once); a call still being taken in (waiting its turn, tokenized or compiled off the
        loop) is not one yet, though admission control counts it."""
        return len(self._streams)

    async def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        if self._state is EngineState.RUNNING:
            raise EngineClosedError("the engine is already running: it was started once ('async with engine:' or "
                                    "'await engine.start()'), and serves on the event loop it was started on")
        if self._state is not EngineState.CREATED:
            raise EngineClosedError(f"the engine cannot be started again (state: {self._state.value}): an engine "
                                    f"runs once; {_LOAD_ANOTHER}")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio, or anyio's trio backend: asyncio's bare "no running event loop" said nothing
            raise WrongEventLoopError(_NO_ASYNCIO_LOOP) from None
        callbacks = LoopCallbacks(self._streams.dispatch, self._embed_calls.resolve, self._on_stopped, self._on_failed)
        thread = EngineThread(list(self._models.generators.values()), loop, callbacks)
        self._link.attach(thread)
        self._state = EngineState.RUNNING
        thread.start()

    async def aclose(self, *, abort: bool = False) -> None:
        """Stop accepting requests, let in-flight ones finish (or abort them), stop the thread.

        Raises:
            InvalidParameterError: ``abort`` that is no bool (the engine thread read it: an object whose
                ``__bool__`` raised ended the step loop, every request failing with EngineDeadError).
        """
        if not isinstance(abort, bool):
            raise InvalidParameterError("abort", abort, "True or False")
        if self._state in (EngineState.CREATED, EngineState.CLOSED):
            self._state = EngineState.CLOSED
            return
        if self._state is EngineState.RUNNING:
            self._state = EngineState.CLOSING
            self._models.open_all_admissions()  # requests waiting on a drain-mode swap now see it closing
            self._post(Stop(abort))
        elif self._state is EngineState.CLOSING and abort:
            # A drain under way (another aclose(), or one that wait_for timed out and cancelled): abort what it
            # waits for. It used to wait for the drain, every request running to its max_tokens.
            self._post(Stop(True))
        if self._link.thread is not None:
            await anyio.to_thread.run_sync(self._link.thread.join)
        if self._state is not EngineState.DEAD:
            self._state = EngineState.CLOSED

    def __enter__(self) -> NoReturn:
        raise TypeError("AsyncEngine is an asynchronous context manager: use 'async with engine:' inside an "
                        "async function (or 'await engine.start()' and 'await engine.aclose()'), not 'with engine:'")

    def __exit__(self, *exc_info: object) -> None:  # never reached: __enter__ raises; 'with' needs both
        return None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose(abort=exc_type is not None)  # leaving on an error aborts what is in flight

    # ------------------------------------------------------------- generation
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        model: str | None = None,
        version_id: int | None = None,
        tenant: str | None = None,
    ) -> RequestOutput:
        """Run one request to its end and return the whole result.

        ``params`` None: :class:`SamplingParams`' defaults (greedy, 128 tokens), cut where the prompt and output
        reach ``max_model_len`` (``truncate_output_to_model_len=True``), so a short context does not refuse the
        default's 128. With ``params.n > 1``, ``outputs`` holds every sample (the flat fields are sample 0's).
        ``cache_salt``: requests share cached prefixes and compiled structured-output specs only within one
        salt (e.g. a tenant); at most 512 characters (the caches keep it after the request).
        Cancelling the awaiting task aborts the request (its blocks return at the next step
        boundary); one aborted with :meth:`abort` ends with ``finish_reason == "abort"``.
        ``model``: the generator's name (default: the first loaded). ``version_id``: the version of that
        model the prompt was made for (token ids its tokenizer or chat template made; :meth:`model_info`'s
        ``version_id``): if a swap replaced it before the request is bound, the request is refused with
        ModelChangedError rather than run by a version whose tokenizer never made those ids.
        ``tenant``: whom the request is for (None, or 1 to 128 printable characters): a structured request's
        grammar compile waits for that tenant's other compiles (else its ``cache_salt``'s), never ahead of
        other tenants' (docs/reliability.md); it changes nothing else.

        Raises (docs/reliability.md): InvalidParameterError (bad prompt or parameters; nothing
        was queued), EngineOverloadedError (``max_waiting_requests``), ModelChangedError (``version_id``
        no longer serves; nothing was queued), RequestFailedError (a fault
        in its step; RequestStalledError: nothing ran for ``stall_timeout``), EngineClosedError /
        WrongEventLoopError (not running, or another loop), EngineDeadError (the step loop broke).
        """
        prompt = plain_prompt(prompt)  # checked as what it holds, not as a subclass says
        args = self._intake.check(prompt, params, request_id, priority, cache_salt, model, self._check_running,
                                  version_id, tenant)
        try:
            request, version, holder, binding = await self._bind(prompt, args, model)
        except AbortedWhileWaiting:
            return _aborted_unbound(args).result()
        result = OutputAssembler.for_request(request)
        async for out in self._submit(request, version, holder, binding):
            result.add(out)
        return result.result()

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        model: str | None = None,
        version_id: int | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Yield :class:`StreamDelta` pieces as tokens are generated; the last has ``finish_reason``.

        With ``params.n > 1`` the samples' deltas interleave, told apart by
        ``delta.index``; each sample's last delta has ``finish_reason`` and the
        stream ends after all ``n`` have finished.
        Cancelling the consuming task aborts the request, and so does breaking out of the loop once the
        stream is closed: at once for a stream written in the ``async for`` line, but one kept in a variable
        runs on until ``await stream.aclose()`` (or ``contextlib.aclosing``) or until nothing refers to it.
        The keywords are :meth:`generate`'s. Raises the same errors as :meth:`generate` at the call itself, before any delta
        (texts over 4096 characters, or past the loop's share of tokenizing in its current turn, tokenized
        off the loop, are length-checked at the first).
        """
        prompt = plain_prompt(prompt)
        args = self._intake.check(prompt, params, request_id, priority, cache_salt, model, self._check_running,
                                  version_id, tenant)
        return self._stream(prompt, args, model)

    async def _stream(self, prompt: Prompt, args: RequestArgs, model: str | None) -> AsyncIterator[StreamDelta]:
        # Read first once the engine was closing or closed (made while it ran); not one that it closed while it was
        # bound (its prompt made off the loop, its turn awaited, ...), which was read in time (pass38).
        read_late = self._state in (EngineState.CLOSING, EngineState.CLOSED)
        try:
            request, version, holder, binding = await self._bind(prompt, args, model)
        except EngineClosedError as exc:
            if read_late:
                raise EngineClosedError(
                    f"the engine was {self._state.value} at this stream's first read: a stream sends its request "
                    "when it is first read, so read it before the engine closes (inside 'async with engine:')"
                ) from exc
            raise
        except AbortedWhileWaiting:
            for i in range(args.params.n):
                yield stream_delta(_aborted_output(args.request_id, i))
            return
        # Closed with this generator: `await stream.aclose()` posts the abort before it returns (an inner generator
        # left to the garbage collector was closed a loop iteration later, its id not yet marked as being aborted).
        async with contextlib.aclosing(self._submit(request, version, holder, binding)) as outputs:
            async for out in outputs:
                yield stream_delta(out)

    async def _bind(self, prompt: Prompt, args: RequestArgs,
                    model: str | None) -> tuple[Request, ModelVersion, ModelHolder, _Binding]:
        """:meth:`RequestIntake.bind`, hearing meanwhile of an :meth:`abort` of its id: the request may wait there
        (its prompt made off the loop, its grammar compiled, admission held by a drain-mode swap) before the engine
        thread knows its id, and an abort then was ignored: the request ran to its end once bound."""
        binding = _Binding()
        waiting = self._binding.setdefault(args.request_id, [])
        waiting.append(binding)
        try:
            request, version, holder = await self._intake.bind(prompt, args, model, self._check_running,
                                                               lambda: binding.aborted)
        finally:
            waiting.remove(binding)
            if not waiting and self._binding.get(args.request_id) is waiting:
                del self._binding[args.request_id]
        return request, version, holder, binding

    def abort(self, request_id: str) -> None:
        """Abort a request by id at the next step boundary (unknown or finished ids are ignored). A request still
        being bound (its prompt made off the loop, its grammar compiled, or waiting for a drain-mode swap) ends as
        an abort as soon as it is (one waiting for its grammar's compile, without it compiled); one waiting its turn
        (a long stop list or chat) ends as one within 0.25 s.

        Raises ``InvalidParameterError`` if ``request_id`` is not a non-empty string.
        """
        request_id = check_request_id(request_id)  # the plain str it holds: the engine thread hashes it
        for binding in self._binding.get(request_id, ()):  # calls not yet bound: aborted once they are posted
            binding.aborted = True
        if self._state in (EngineState.RUNNING, EngineState.CLOSING):
            self._post(AbortRequest(request_id))

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, model: str | None = None) -> list[int]:
        """Render chat messages with a generator's template (generation prompt added) into token ids.

        Messages too long to fit the generator's ``max_model_len`` whatever their tokens are refused by
        their characters first, untokenized (as :meth:`generate` refuses them)."""
        version = current(self._models.generator(model))
        if isinstance(messages, (str, bytes)):  # iterated, a text read as messages 'h', 'i', ...: named whole
            raise InvalidParameterError("prompt", messages, "a list of chat messages ({'role': ..., 'content': ...}); "
                                        "tokenize() takes a text as it is")
        messages = plain_prompt(messages)
        if not isinstance(messages, list) or not messages:  # None, a number, a generator, another object: iterated,
            # a bare error; [] reached the template, refused as the value 'chat messages'
            raise InvalidParameterError("prompt", messages, "a non-empty list of chat messages "
                                        "({'role': ..., 'content': ...})")
        check_prompt_chars(messages, version)
        return chat_token_ids(version, messages)

    def tokenize(self, prompt: Prompt, *, model: str | None = None) -> list[int]:
        """The token ids ``prompt`` (a text, chat messages or token ids) is sent as, exactly as :meth:`generate`
        would send it (chat messages templated). A prompt too long to fit ``max_model_len`` whatever its
        tokens is refused by its characters first, untokenized. Raises :class:`InvalidParameterError`."""
        version = current(self._models.generator(model))
        prompt = plain_prompt(prompt)
        check_prompt_chars(prompt, version)
        return prompt_token_ids(prompt, version)

    def check_prompt_size(self, prompt: Prompt, *, model: str | None = None) -> None:
        """Refuse, untokenized, a prompt (a text, chat messages or token ids) too long to fit a generator's
        ``max_model_len`` whatever its tokens are: more characters than that many tokens can hold, more token ids,
        or more chat messages than any prompt may have, as :meth:`generate` refuses it at its call. For a caller
        that renders or tokenizes a prompt itself (the HTTP server's tools chats), before that work. Raises
        :class:`PromptTooLongError` (an :class:`InvalidParameterError`), counted in the metrics' rejected requests as
        :meth:`generate`'s refusal is."""
        self._check_running()
        with self._intake.counting_refusals(model):
            version = current(self._models.generator(model))
            prompt = plain_prompt(prompt)
            check_prompt_chars(prompt, version)
            kind = prompt_kind(prompt)
            if kind is None:  # a number, None, bytes: what generate refuses as no prompt (pass76)
                raise InvalidParameterError("prompt", prompt, "a non-empty string, list of chat messages or list of "
                                            "token ids")
            if kind == "text":  # "" and a lone surrogate, as generate refuses them (pass77)
                check_text_prompt(prompt)

    def check_request(self, prompt: Prompt, params: SamplingParams | None = None, *, model: str | None = None) -> None:
        """Refuse now what :meth:`generate` would refuse whatever the engine's load: ``params`` the generator cannot
        run (``n`` past ``max_num_seqs``, a stop token id past its vocabulary, stop strings without a tokenizer), a
        prompt of token ids that does not fit or holds an id past the vocabulary, a text or chat too long by its
        characters alone or asking a ``max_tokens`` no prompt leaves room for (``max_model_len`` or more; a text is
        not tokenized here). For a caller that takes places of its own before it submits (the HTTP server's
        per-tenant limit), so that a request no retry can run is its 400, not a 429 or 503. Nothing is admitted or
        held; :meth:`generate` checks it all again. A refusal counts in the metrics' rejected requests, as
        :meth:`generate`'s does (so do :meth:`check_admission`'s, once a call, and :meth:`taking_in`'s). Raises
        :class:`InvalidParameterError`."""
        self._check_running()
        with self._intake.counting_refusals(model):
            params, _, _ = check_request_args(params, 0, None)
            self._intake.check_valid(plain_prompt(prompt), params, model)

    def check_admission(self, count: int, *, model: str | None = None) -> None:
        """Whether ``count`` requests submitted now would all be admitted by the engine's admission control
        (``max_waiting_requests``; nothing to check without it): for a caller about to submit several prompts
        as one call, so that it is refused whole rather than half queued. Raises InvalidParameterError on
        ``prompt`` when ``count`` exceeds ``max_num_seqs + max_waiting_requests`` (no retry can succeed),
        EngineOverloadedError when they do not fit beside the requests in flight now (retry later). Each
        request is still checked as it is submitted."""
        self._check_running()
        count = plain_value(count)  # the number it holds: an int subclass's comparisons may lie
        check_int("count", count, 1, 2**31)
        with self._intake.counting_refusals(model):  # once for the call, however many prompts it holds
            self._intake.check_room(model, count)

    @contextlib.contextmanager
    def taking_in(self, *, model: str | None = None) -> Iterator[None]:
        """A place for one request the caller makes before submitting it (waiting a line of its own, rendering its
        prompt): refused at once as ``check_admission(1)`` refuses it, and counted in flight by admission control
        (``max_waiting_requests``) until the block ends, as a request waiting its turn inside the engine is; submit
        the request once the block has ended (it is checked again then). The HTTP server holds one for each long
        chat waiting its turn in its own line and rendered there."""
        self._check_running()
        with contextlib.ExitStack() as place:
            with self._intake.counting_refusals(model):  # a refusal counted; what the caller's block raises is its own
                place.enter_context(self._intake.taking_in(model))
            yield

    def count_tokens(self, prompt: Prompt, *, model: str | None = None) -> int:
        """How many tokens ``prompt`` (a text, chat messages or token ids) takes, exactly as
        :meth:`generate` would send it (chat messages templated; refused by its characters first, as
        :meth:`tokenize`). Raises :class:`InvalidParameterError`."""
        return len(self.tokenize(prompt, model=model))

    async def _submit(self, request: Request, version: ModelVersion, holder: ModelHolder,
                      binding: _Binding | None = None) -> AsyncIterator[CoreOutput]:
        """Hand a request to ``version``'s core and yield its outputs; abort it if the consumer goes away, or at
        once if :meth:`abort` named it while it was being bound (``binding``)."""
        # No await separates this from RequestIntake.bind, which bound the request
        # to ``version`` and tokenized and validated it with it.
        stream = self._streams.open(request.request_id, request.params.n, version.version_id, holder)
        self._post(AddRequest(version, request))
        if binding is not None and binding.aborted:
            self._post(AbortRequest(request.request_id))  # handled right after it is added: it ends as an abort
        done = 0
        try:
            while done < stream.n:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # the core failed the request and ended all its samples
                    done = stream.n
                    raise item.error
                if item.finish_reason is not None:
                    done += 1
                yield item
        finally:
            if done < stream.n:
                self._release_when_gone(request.request_id, stream)

    def _release_when_gone(self, request_id: str, stream: RequestStream) -> None:
        """Abort a request whose consumer went away; its id is free once the thread confirms."""
        if self._state in (EngineState.RUNNING, EngineState.CLOSING):
            self._streams.abandon(stream)
            self._post(AbortRequest(request_id, confirm=lambda: self._streams.release(request_id, stream)))
        else:  # no thread will answer (closed or dead): nothing can arrive for it any more
            self._streams.release(request_id, stream)

    # -------------------------------------------------------------- embeddings
    async def embed(
        self, texts: str | Sequence[str], *, model: str | None = None, tenant: str | None = None
    ) -> torch.Tensor:
        """Sentence embeddings of ``texts``: a float32 CPU tensor ``[len(texts), dim]``.

        Rows are unit-length when the model normalises (sentence-transformers' Normalize module;
        all-MiniLM-L6-v2 does). A single string gives one row. Texts over the model's ``max_seq_len``
        tokens are truncated, as sentence-transformers does. Concurrent calls' texts are batched
        together (:class:`~asyncinfer.embedding.EmbeddingConfig`: ``max_batch_size``, ``max_wait_ms``).
        ``model``: the embedding model's name (default: the first loaded). ``tenant``: whom the call is
        for (1 to 128 printable characters): the batches take one text of each waiting tenant in turn,
        each tenant's calls taking its turns in turn, so a tenant with many calls queued gets no more of
        every batch than one with a single call (None: all calls without a tenant are one tenant).
        Cancelling the awaiting task drops the call's texts still queued.

        Raises:
            InvalidParameterError: bad ``texts``, ``model`` or ``tenant`` (nothing was queued).
            RequestAbortedError: the call was aborted (remove_model or aclose with abort=True),
                or the encoder raised on its batch (the cause is chained; the engine keeps serving).
            EngineClosedError / EngineDeadError: the engine is not running.
        """
        self._check_running()
        entry = self._models.embedder(model)
        checked, group = check_texts(texts), check_tenant(tenant)
        return await self._embed_calls.submit(entry, checked, self._post, self._embedder_still(entry), group)

    def _embedder_still(self, entry: EmbeddingModel) -> Callable[[], None]:
        """A check that the engine runs and ``entry`` is still loaded (after an await)."""
        def check() -> None:
            self._check_running()
            if self._models.embedders.get(entry.name) is not entry:
                raise InvalidParameterError("model", entry.name, "a loaded embedding model (it was removed meanwhile)")
        return check

    def embedding_stats(self, model: str | None = None) -> EmbeddingStats:
        """What an embedding model's batcher did: calls, texts, batches and their sizes, tokens."""
        return self._models.embedder(model).batcher.stats()

    # ----------------------------------------------------------- introspection
    def kv_stats(self, model: str | None = None) -> KVCacheStats:
        """A snapshot of a generator's KV cache figures (see :class:`KVCacheStats`); read while
        the engine runs, it may be off by one step. ``model``: which (default: the first loaded)."""
        return self._models.core(model).kv.stats()

    def step_stats(self, model: str | None = None) -> StepStats:
        """A copy of a generator's step counters (see :class:`StepStats`) since its current
        version started serving. ``model``: which generator (default: the first loaded)."""
        stats = self._models.core(model).stats
        return dataclasses.replace(stats, batch_sizes=list(stats.batch_sizes))

    def memory_report(self) -> MemoryReport:
        """Where the memory is, to tell a leak from a cache: per live model version its weights, KV
        pool, blocks held by requests and free blocks still caching prefixes, requests in flight;
        and the process's memory (torch's CUDA allocator, and RSS). See :class:`MemoryReport`."""
        return memory_report(self, self.metrics.live_versions())

    async def profile(self, steps: int = 10, path: str | os.PathLike[str] = "asyncinfer-profile") -> ProfileResult:
        """Run the next ``steps`` generation steps (of any generator, with the engine thread's work between
        them, embedding batches included) under ``torch.profiler``, then write ``path``/trace.json (a Chrome
        trace: chrome://tracing or Perfetto) and ``path``/top_ops.txt (the ops by self time). Waits until that
        many steps have run: send traffic meanwhile.

        Raises:
            InvalidParameterError: ``steps`` outside [1, 10000] (the profiler holds every step's ops in memory
                until it writes them), a ``path`` that cannot be made a writable directory (a file, a NUL in it),
                a profile is already running, or the engine holds no generator (an embedding batch is no
                step: the call waited for ever).
            EngineClosedError / EngineDeadError: the engine is not running (or stops meanwhile).
        """
        self._check_running()
        if not self.metrics.live_versions():
            raise InvalidParameterError(
                "steps", steps, "generation steps", message="profile() counts generation steps, and this engine "
                "holds no generator (an embedding batch is no step, so the call would wait for ever): add a "
                "generator with add_model() first")
        return await profile_steps(self.metrics, self._link, steps, path)

    def model_info(self) -> list[ModelVersionInfo]:
        """The live models and versions: name, kind, id, source, state, requests in flight, memory plan.

        Generators first, in load order (live versions oldest first), then embedding models. An old
        version, or a model being removed, is ``"draining"`` until its last request has ended. Once the
        engine is closed (or its step loop has broken) every entry's state is ``"closed"`` (or ``"dead"``):
        none takes requests, and the entries say what was loaded.
        """
        infos = self._models.infos(self._streams.in_flight)
        if self._state in (EngineState.CLOSED, EngineState.DEAD):  # "current" said it still served
            infos = [dataclasses.replace(info, state=self._state.value) for info in infos]
        return infos

    def reset_prefix_cache(self) -> None:
        """Forget every generator's cached prompt prefixes, at the next step boundary: requests
        submitted later never reuse blocks cached before; those in flight keep what they hold."""
        if self._state in (EngineState.RUNNING, EngineState.CLOSING):
            self._post(ResetPrefixCache())
        else:  # no step loop is running: nothing can race with it
            self._models.reset_prefix_caches()

    # ------------------------------------------------------------------ models
    async def swap_model(
        self,
        model: ModelRef = None,
        *,
        name: str | None = None,
        mode: str = "overlap",
        abort: bool = False,
        available_bytes: int | None = None,
        **options: Any,
    ) -> ModelVersionInfo:
        """Replace a served generator; returns once the new version takes requests.

        ``name``: which generator (default: the first loaded; it keeps its name).
        ``model`` is what :meth:`from_pretrained` takes; ``options`` override the
        current version's options. The new version loads and warms up in a worker
        thread while the old one serves, and is switched in at a step boundary;
        requests keep the version they were admitted on, and the old version is
        dropped once its last request ends (docs/model_swaps.md).

        ``mode="overlap"`` (default) needs the new version's weights, KV cache
        and activation reserve to fit beside the old one in the memory available
        now (or ``available_bytes``). ``mode="drain"`` pauses admission from the
        call on (requests sent meanwhile wait for the new version), finishes (or with ``abort=True`` aborts) the old version's requests,
        drops it, then loads the new one. A swap waits for a swap in progress.

        Raises:
            InvalidParameterError: a bad ``mode``, ``name`` or option; nothing was loaded.
            ConfigurationError: overlap mode and the new version does not fit
                beside the old one (the message has the numbers).
            SwapError: the new version could not be loaded, checked or warmed
                up; the old version keeps serving (in drain mode it is loaded
                again from its source).
            EngineClosedError / EngineDeadError: the engine is not running.
        """
        return await self._changes.swap(model, name, mode, abort, available_bytes, options)

    async def add_model(
        self, name: str, model: ModelRef, *, available_bytes: int | None = None, **options: Any
    ) -> ModelVersionInfo:
        """Load another model into this engine under ``name``; returns once it serves.

        ``model`` is what :meth:`from_pretrained` takes. A BERT-family sentence
        encoder (e.g. "all-MiniLM-L6-v2") becomes an embedding model for
        :meth:`embed` (:class:`~asyncinfer.embedding.EmbeddingConfig` options);
        anything else a generator with its own options, KV cache and prefix cache
        (``kv_cache_fraction`` is of the memory free when it is added). ``device``
        defaults to the engine's. It loads in a worker thread while the others serve,
        after its memory was checked against what is available now (or ``available_bytes``).

        Raises:
            InvalidParameterError: a bad or taken ``name``, or a bad option.
            ConfigurationError: the model does not fit beside the loaded ones (with the numbers).
            ModelLoadError: the model cannot be found, loaded or warmed up; nothing changed.
            EngineClosedError / EngineDeadError: the engine is not running.
        """
        return await self._changes.add(name, model, available_bytes, options)

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
        await self._changes.remove(name, abort)

    # ------------------------------------------------------ the engine thread
    def _post(self, command: Command) -> None:  # to the engine thread
        self._link.post(command)
    def _on_stopped(self) -> None:
        self._link.fail_waiters(EngineClosedError("the engine was closed"))

    def _on_failed(self, exc: BaseException) -> None:
        self._state = EngineState.DEAD
        self._dead_cause = exc
        message = "the engine's step loop failed"
        self._streams.fail_all(EngineDeadError, message, exc)
        self._link.fail_waiters(EngineDeadError(message))
        self._embed_calls.fail_all(EngineDeadError, message, exc)

    def _check_running(self) -> None:
        self._link.check_loop()
        if self._state is EngineState.DEAD:
            raise EngineDeadError("the engine's step loop failed") from self._dead_cause
        if self._state is EngineState.CREATED:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # under trio "use 'async with engine:'" led to start()'s refusal: say it here
                raise WrongEventLoopError(_NO_ASYNCIO_LOOP) from None
            raise EngineClosedError("the engine is not started yet: use 'async with engine:' or "
                                    "'await engine.start()'")
        if self._state is EngineState.CLOSING:
            raise EngineClosedError("the engine is closing: it takes no new requests")
        if self._state is not EngineState.RUNNING:
            raise EngineClosedError(f"the engine is closed and cannot be started again: {_LOAD_ANOTHER}")

    def _check_usable(self) -> None:
        """Model changes work before start (nothing races) and while running."""
        if self._state is not EngineState.CREATED:
            self._check_running()

