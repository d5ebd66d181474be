"""The engine thread: the one thread that runs model work.

It steps every generator's cores, runs the embedding batches that are due, and
takes typed commands from the event loop through one FIFO inbox (a command
posted before another is handled before it, at a step boundary). Everything it
hands back to the event loop goes through one path, :meth:`EngineThread.to_loop`
(``loop.call_soon_threadsafe``, quiet once the loop is closed).

The thread owns the :class:`ModelHolder` objects' ``live`` versions and the
embedding batchers' queues; the event loop never touches them while it runs.
No asyncio here beyond handing callbacks to the loop.

Faults: a step that raises fails only its requests, and a command that cannot
be carried out for one request (``AddRequest``) fails only that request; the
thread dies (every waiter gets ``EngineDeadError``) on any other exception and
when one model's steps fail ``max_consecutive_step_failures`` times in a row
(see :mod:`asyncinfer.holder`). When no core with requests can schedule any,
the thread waits for a command with a growing timeout
(:func:`asyncinfer.holder.idle_backoff`) instead of spinning.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncinfer.embedding import EmbedCall, EmbeddingBatcher
from asyncinfer.errors import RequestAbortedError, WrongEventLoopError
from asyncinfer.holder import ModelHolder, ModelVersion, idle_backoff
from asyncinfer.outputs import CoreOutput
from asyncinfer.request import Request

logger = logging.getLogger("asyncinfer")


# ------------------------------------------------------------------ commands
@dataclass(frozen=True)
class AddRequest:
    """Add ``request`` to ``version``'s core (the version it was bound to at admission)."""

    version: ModelVersion
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request (all its samples) by the user's id, on whichever version holds it.

    ``confirm`` (if given) is called on the loop after the abort's outputs were
    handed over: from then on no output of that request can reach the loop.
    """

    request_id: str
    confirm: Callable[[], Any] | None = None


@dataclass(frozen=True)
class QueueEmbed:
    """Queue an ``embed()`` call's texts on an embedding model's batcher."""

    batcher: EmbeddingBatcher
    call: EmbedCall


@dataclass(frozen=True)
class AbortEmbeds:
    """Fail every call queued on ``batcher`` with ``error(reason)``."""

    batcher: EmbeddingBatcher
    reason: str


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached prefix of every generator."""


@dataclass(frozen=True)
class SwitchVersion:
    """Step ``version`` for ``holder`` and drain the others, then call ``done``."""

    holder: ModelHolder
    version: ModelVersion
    done: Callable[[], Any]  # called on the engine thread once the switch is made


@dataclass(frozen=True)
class DrainVersion:
    """Mark ``version`` draining (no successor yet); with ``abort``, end its requests now."""

    holder: ModelHolder
    version: ModelVersion
    abort: bool


@dataclass(frozen=True)
class AddHolder:
    """Start stepping a generator added with ``add_model``."""

    holder: ModelHolder


@dataclass(frozen=True)
class RemoveHolder:
    """Retire every live version of a removed generator (the serving one and those still draining after an
    overlapping swap; with ``abort``, end their requests now), stop stepping it once none is left, then call
    ``done``."""

    holder: ModelHolder
    abort: bool
    done: Callable[[], Any]  # called on the engine thread once the holder is no longer stepped


@dataclass(frozen=True)
class Stop:
    """Finish what is in flight (or abort it all), then end the thread."""

    abort: bool


Command = (
    AddRequest | AbortRequest | QueueEmbed | AbortEmbeds | ResetPrefixCache | SwitchVersion | DrainVersion
    | AddHolder | RemoveHolder | Stop
)


@dataclass(frozen=True)
class LoopCallbacks:
    """What the thread calls on the event loop (each through :meth:`EngineThread.to_loop`)."""

    outputs: Callable[[list[CoreOutput]], Any]  # a step's (or a command's) outputs
    embed_done: Callable[[EmbedCall, torch.Tensor | BaseException], Any]  # an embed call's vectors, or its error
    stopped: Callable[[], Any]  # the thread ended after a Stop
    failed: Callable[[BaseException], Any]  # the thread died of this exception


# --------------------------------------------------------------------- thread
class EngineThread:
    """The step loop's thread: ``post`` commands in, callbacks out on the event loop."""

    def __init__(self, holders: list[ModelHolder], loop: asyncio.AbstractEventLoop, callbacks: LoopCallbacks) -> None:
        self.loop = loop
        self.callbacks = callbacks
        self._holders = list(holders)
        self._batchers: list[EmbeddingBatcher] = []  # with texts queued
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._removing: dict[ModelHolder, Callable[[], Any]] = {}  # removed holders still draining: their done
        self._idle_wait = 0.0  # the back-off while nothing can be scheduled (0: not backing off)
        self._thread = threading.Thread(target=self._run, name="asyncinfer-core", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        """Block until the thread has ended (call it from a worker thread, not the loop)."""
        self._thread.join()

    def post(self, command: Command) -> None:
        """Hand a command to the thread (any thread may call this)."""
        self._inbox.put(command)
        self._wake.set()

    def to_loop(self, callback: Callable[..., Any], *args: Any) -> None:
        """The one way back to the event loop; silent once the loop is closed (nobody listens)."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
            self.to_loop(self.callbacks.stopped)
        except BaseException as exc:  # any failure kills the engine, loudly (logged below)
            logger.exception("asyncinfer step loop failed")
            self.to_loop(self.callbacks.failed, exc)

    def _iterate(self) -> bool:
        """One pass: commands, retirements, due embedding batches, one step of every generator.

        Returns False once the thread should end.
        """
        self._wake.clear()
        self._drain_inbox()
        for holder in self._holders:
            holder.retire_idle()
        self._drop_removed()
        busy = any(h.has_unfinished_requests() for h in self._holders)
        # At most one embedding batch per model between two generation steps, within its share when busy.
        embed_wait = self._run_embedding_batches(flush=self._stopping, busy=busy)
        if not busy:
            if embed_wait is not None:  # texts wait for more to batch with
                if embed_wait > 0:
                    self._wake.wait(embed_wait)
                return True
            if self._stopping:
                return False
            self._wake.wait()
            return True
        outputs: list[CoreOutput] = []
        for holder in self._holders:
            outputs.extend(holder.step())
        self._emit(outputs)
        if any(holder.progressed for holder in self._holders):
            self._idle_wait = 0.0
        else:  # requests wait and none could be scheduled: a command (or time) must change something
            self._idle_wait = idle_backoff(self._idle_wait)
            self._wake.wait(self._idle_wait if embed_wait is None else min(self._idle_wait, embed_wait))
        return True

    def _emit(self, outputs: list[CoreOutput]) -> None:
        if outputs:
            self.to_loop(self.callbacks.outputs, outputs)

    def _drain_inbox(self) -> None:
        """Carry out every queued command, handing each one's outputs over before the next."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._emit(self._handle(command))
            if isinstance(command, AbortRequest) and command.confirm is not None:
                self.to_loop(command.confirm)

    def _handle(self, command: Command) -> list[CoreOutput]:
        """Carry out one command; the outputs it produced (aborted requests' finals)."""
        match command:
            case AddRequest(version, request):
                assert version.core is not None, "a request was bound to a retired version"
                return version.core.add_request(request)  # [] or the request's failure
            case AbortRequest(request_id, _):
                return [out for holder in self._holders for out in holder.abort(request_id)]
            case QueueEmbed(batcher, call):
                if batcher not in self._batchers:
                    self._batchers.append(batcher)
                batcher.add(call)
            case AbortEmbeds(batcher, reason):
                self._fail_embeds(batcher, reason)
            case ResetPrefixCache():
                for holder in self._holders:
                    holder.reset_prefix_cache()
            case SwitchVersion(holder, version, done):
                holder.switch(version)
                done()
            case DrainVersion(holder, version, abort):
                return holder.drain(version, abort=abort)
            case AddHolder(holder):
                self._holders.append(holder)
            case RemoveHolder(holder, abort, done):
                self._removing[holder] = done
                return holder.drain_all(abort=abort)
            case Stop(abort):
                self._stopping = True
                if abort:
                    for batcher in self._batchers:
                        self._fail_embeds(batcher, "the engine was closed with abort=True")
                    return [out for holder in self._holders for out in holder.abort_all()]
        return []

    def _drop_removed(self) -> None:
        """Stop stepping each removed holder whose last version has been dropped, and say so."""
        for holder, done in list(self._removing.items()):
            if not holder.live:
                self._holders.remove(holder)
                del self._removing[holder]
                done()

    # ------------------------------------------------------------- embeddings
    def _run_embedding_batches(self, *, flush: bool, busy: bool) -> float | None:
        """Run each embedding model's batch that is due (all that wait, when ``flush``); while generators are
        ``busy``, only a batch its model's ``max_busy_share`` allows. Seconds until the next one is due, or None
        when no text waits."""
        soonest: float | None = None
        for batcher in list(self._batchers):
            wait = batcher.wait_time()
            if wait == 0 and busy and not flush:
                wait = batcher.busy_wait()
            if wait is not None and (wait == 0 or flush):
                for call in batcher.run_batch():
                    self.to_loop(self.callbacks.embed_done, call, call.error or call.stacked())
                wait = batcher.wait_time()
                if flush and wait is not None:
                    wait = 0.0
            if wait is None:
                self._batchers.remove(batcher)
            elif soonest is None or wait < soonest:
                soonest = wait
        return soonest

    def _fail_embeds(self, batcher: EmbeddingBatcher, reason: str) -> None:
        for call in batcher.take_all():
            self.to_loop(self.callbacks.embed_done, call, RequestAbortedError(reason))


# ------------------------------------------------------------ the loop's end
class ThreadLink:
    """The event loop's end of the engine thread: post commands, wait for the thread's answers.

    Loop side only. Before :meth:`attach` there is no thread (the engine was not
    started): model changes then act directly, nothing can race with them.
    Futures awaited through :meth:`wait_for` fail at once with the error given to
    :meth:`fail_waiters` when the thread stops or dies, so nothing waits forever.
    """

    def __init__(self) -> None:
        self.thread: EngineThread | None = None
        self._waiters: set[asyncio.Future[None]] = set()
        self._ended: BaseException | None = None  # what fail_waiters was given: the thread stopped or died

    def attach(self, thread: EngineThread) -> None:
        self.thread = thread

    @property
    def started(self) -> bool:
        return self.thread is not None

    def check_loop(self) -> None:
        """Raise :class:`WrongEventLoopError` unless called on the loop the thread delivers to."""
        if self.thread is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self.thread.loop and self.thread.loop.is_closed():
            raise WrongEventLoopError(
                "the event loop this engine was started on has closed (the asyncio.run() that started it has "
                "ended): an engine serves on one loop for its whole life, so start and use it within one "
                "asyncio.run() (e.g. 'async with engine:' in your main()); 'await engine.aclose()' still frees it "
                "from here"
            )
        if running is not self.thread.loop:
            raise WrongEventLoopError(
                "this engine is bound to the event loop it was started on; from another thread, use "
                "asyncio.run_coroutine_threadsafe(engine.generate(...), engine.loop)"
            )

    def post(self, command: Command) -> None:
        assert self.thread is not None, "the engine thread is not started"
        self.thread.post(command)

    def resolver(self, future: asyncio.Future[None]) -> Callable[..., None]:
        """A callback for the engine thread that resolves ``future`` on the loop."""
        def resolve(*_args: Any) -> None:
            assert self.thread is not None
            self.thread.to_loop(lambda: None if future.done() else future.set_result(None))

        return resolve

    async def wait_for(self, future: asyncio.Future[None], command: Command | None = None) -> None:
        """Post ``command`` (if any) and wait until the thread resolves ``future``; once the thread has stopped or
        died, fail at once with the error :meth:`fail_waiters` was given (a wait begun after it, by a call that
        awaited something else first, such as ``profile()`` checking its path, waited for ever)."""
        if self._ended is not None:
            raise copy.copy(self._ended)
        self._waiters.add(future)
        try:
            if command is not None:
                self.post(command)
            await future
        finally:
            self._waiters.discard(future)

    def fail_waiters(self, exc: BaseException) -> None:
        """The thread stopped or died: fail every wait, now and from now on, with ``exc``."""
        self._ended = exc
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_exception(exc)
