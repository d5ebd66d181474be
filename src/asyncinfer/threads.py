"""Torch work that must not outlive its thread: :func:`on_own_thread`.

PyTorch's CPU kernels split their work with OpenMP. The OpenMP runtime torch ships
(GNU libgomp) keeps a team of worker threads for every thread that has run a parallel
region, for as long as that thread lives. Once the threads it manages outnumber the
CPUs, its workers stop spinning between regions and sleep instead, and every parallel
region on any thread then waits for a wake-up. With torch's default of one thread per
core, one team beyond the engine thread's is already too many: a model loaded on the
caller's thread (which lives on) slowed the engine thread's decoding 1.51x at one
request and 1.34x at 16 (``benchmarks/threads.py``; docs/formats.md, "Threads and OpenMP").

So loading (weights, packing, warm-up) runs on a thread of its own that ends with the
load, and its team ends with it; the engine thread is then the only one with a team.

And a caller's work in a worker thread holds its place until it ends: :func:`run_sync_to_end`; one party's work
takes at most a few worker threads at once: :class:`WorkShares`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may run on
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 2


#: How much lower than the process's the OS priority of the threads that run :class:`WorkShares`' work is (Unix
#: ``nice``; 0: the same). The engine thread decodes in parallel regions its worker threads finish together: a
#: flood's texts tokenized beside it, at its priority, left those workers waiting their turn at every region (a
#: neighbour's call 7.4 s under a flood at the same priority, 2.5 s below it, 0.09 s alone, with the tokenizers'
#: own pool off; ``benchmarks/body_flood.py``, docs/reliability.md). Read when the first such thread starts
#: (:func:`close_work_executor`).
WORK_THREAD_NICE = 10

#: The threads that run :class:`WorkShares`' work, all callers' together.
MAX_WORK_THREADS = 40

_work_executor: concurrent.futures.ThreadPoolExecutor | None = None
_work_executor_lock = threading.Lock()


def _lower_priority() -> None:
    """This thread's OS priority, :data:`WORK_THREAD_NICE` below its creator's (Linux sets it per thread; where the
    OS cannot, it stays)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORK_THREAD_NICE))
    except (AttributeError, OSError):  # not Unix, or not allowed
        pass


def work_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's threads for :class:`WorkShares`' work (:data:`MAX_WORK_THREADS`, at :data:`WORK_THREAD_NICE`),
    made at first use."""
    global _work_executor
    with _work_executor_lock:
        if _work_executor is None:
            _work_executor = concurrent.futures.ThreadPoolExecutor(
                MAX_WORK_THREADS, thread_name_prefix="asyncinfer-work", initializer=_lower_priority)
        return _work_executor


def close_work_executor() -> None:
    """Let the work threads end once their work has (the next use makes new ones, with :data:`MAX_WORK_THREADS` and
    :data:`WORK_THREAD_NICE` as they are then)."""
    global _work_executor
    with _work_executor_lock:
        executor, _work_executor = _work_executor, None
    if executor is not None:
        executor.shutdown(wait=False)


#: The worker threads one party's work (a tenant's, a key's) takes at once (:class:`WorkShares`): half the CPUs this
#: process may use, at least 2 (tokenizing lets go of the interpreter's lock: one call's many long prompts run faster
#: on more threads, where there are the cores for them).
WORK_THREADS_PER_PARTY = max(2, _cpus() // 2)

# How often a caller waiting for its call looks for a Ctrl-C that reached another thread (seconds).
_SIGNAL_POLL_S = 0.1


def on_own_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` on a new thread that ends with the call; its result, or its exception.

    Blocking: the caller waits for the call (in a coroutine, ``await asyncio.to_thread(on_own_thread,
    fn, ...)`` keeps the event loop running). The call sees the caller's context variables and its
    torch grad and inference modes; other per-thread torch state (the default device, the OpenMP
    thread count of a thread that set its own) is the new thread's, and ``fn`` cannot install
    signal handlers (only the main thread can). A ``KeyboardInterrupt`` (Ctrl-C) in the caller while
    it waits is raised inside the call too, as it would have been had the call run on the caller's
    thread; the caller waits for the call to unwind, then raises it. The OpenMP workers of the
    thread's team (libgomp) leave shortly after the thread ends.
    """
    return run_on_own_thread("asyncinfer-own-thread", fn, *args, **kwargs)


def run_on_own_thread(name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """:func:`on_own_thread` with the thread named ``name``."""
    import torch

    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    context = contextvars.copy_context()
    result: list[T] = []
    error: list[BaseException] = []

    def call() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn(*args, **kwargs)

    done = threading.Event()

    def run() -> None:
        try:
            result.append(context.run(call))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, re-raised there
            error.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    try:
        thread.start()
        # Not thread.join(): a join interrupted by Ctrl-C marks a running thread as ended. Not an untimed
        # wait either: the kernel may hand SIGINT to any of the process's threads (the call's, torch's), and
        # then Python's handler is only flagged; the main thread, asleep in an untimed wait, would not run it
        # until the call had ended. A timed wait returns to Python often enough to see it.
        while not done.wait(_SIGNAL_POLL_S):
            pass
    except KeyboardInterrupt:
        # Ctrl-C: interrupt the call as well, and wait until it has unwound; a thread still in
        # torch's code while the interpreter exits can abort the process.
        if not done.is_set() and thread.is_alive():
            _raise_in(thread, KeyboardInterrupt)
        _wait_uninterrupted(done, thread)
        raise
    thread.join()
    if error:
        exc = error.pop()
        try:
            raise exc
        finally:
            del exc  # the traceback would hold this frame, and the frame the exception: a cycle
    return result.pop()


#: Held while a thread is started from code that may run on an own thread (:func:`start_thread`): a thread not yet
#: running carries its creator's id, so an exception raised "in" the creator landed in it too, killed it before it
#: said it had started, and the creator waited in ``Thread.start()`` for ever (Ctrl-C during a load hung it: pass95).
_STARTING = threading.Lock()


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``, never at the moment :func:`_raise_in` raises in the thread that starts it."""
    with _STARTING:
        thread.start()


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in ``thread`` at its next Python instruction (CPython; elsewhere nothing); never while a
    thread is being started (:func:`start_thread`)."""
    try:
        import ctypes

        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    except (ImportError, AttributeError):  # not CPython: the call runs to its end
        return
    if thread.ident is not None:
        with _STARTING:
            set_async_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type))


def _wait_uninterrupted(done: threading.Event, thread: threading.Thread) -> None:
    """Wait until the call is done (or its thread gone), absorbing further Ctrl-Cs: the caller
    re-raises the first one."""
    while not done.is_set() and thread.is_alive():
        try:
            done.wait(0.05)
        except KeyboardInterrupt:
            continue


class _NeverRan(Exception):
    """The worker thread's answer to a caller that left before its work began."""


class _Gate:
    """Whether the work began in its worker thread (:meth:`begin`) or its caller left before it did (:meth:`leave`):
    exactly one of them wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "waiting"

    def begin(self) -> bool:
        """In the worker thread: True if the work may run (its caller has not left)."""
        with self._lock:
            if self._state == "waiting":
                self._state = "running"
            return self._state == "running"

    def leave(self) -> bool:
        """On the loop, the caller cancelled: True if the work has begun (the caller waits for it)."""
        with self._lock:
            if self._state == "waiting":
                self._state = "left"
            return self._state == "running"


def _in_executor(executor: concurrent.futures.Executor, fn: Callable[[], T]) -> asyncio.Future[T]:
    """``fn()`` in one of ``executor``'s threads, in the caller's context (as anyio hands it to its threads): a future
    of the loop's own, given the outcome and holding it alone. An error ``fn`` returns as a value keeps its frames,
    and theirs the worker's that called them: nothing there may lead back to the future that holds that value, or
    the two are a cycle, freed only by a full garbage collection (a refused 4 MiB body's error and its frames;
    tests/server/test_fresh_pass32.py). So not ``run_in_executor`` (its chained futures refer to each other), and the
    worker is handed a box it empties."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    queued = executor.submit(_run_boxed, [loop, done, contextvars.copy_context(), fn])  # its own result: None
    done.add_done_callback(lambda future: future.cancelled() and queued.cancel())
    return done


def _run_boxed(box: list[Any]) -> None:
    """In a worker thread: ``box`` = [loop, future, context, fn]; the future given ``fn``'s outcome on its loop. The
    box is emptied first and the frame's names dropped after, so the frame holds nothing of the call."""
    loop, done, context, fn = box
    box.clear()
    try:
        outcome: tuple[bool, Any] = (True, context.run(fn))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        outcome = (False, exc)
    try:
        loop.call_soon_threadsafe(_settle, done, outcome)
    except RuntimeError:  # the loop has closed: nobody waits
        pass
    del loop, done, context, fn, outcome


def _settle(done: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if not done.done():  # a caller that left before the call began has cancelled it
        ok, value = outcome
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)


async def run_sync_to_end(fn: Callable[..., T], /, *args: Any, limiter: anyio.CapacityLimiter | None = None,
                          executor: concurrent.futures.Executor | None = None) -> T:
    """``fn(*args)`` in a worker thread (one of ``executor``'s, else one of ``limiter``'s places, else anyio's shared
    pool), on an asyncio loop. A cancel of the caller while ``fn`` runs (asyncio's, as ``wait_for`` or a client's disconnect sends) is
    raised once ``fn`` has returned, the caller holding its place (and whatever it holds: a turn) till then;
    before ``fn`` began, at once, and ``fn`` never runs. anyio's ``run_sync`` waits for its thread under anyio's
    own cancel scopes only: an asyncio cancel ended the call at once while its work ran on, its place given back,
    so a caller cancelling each costly call as it began (a grammar's compile, a long text's tokenizing) ran any
    number of them at once."""
    gate = _Gate()

    def guarded() -> T:
        if not gate.begin():
            raise _NeverRan
        return fn(*args)

    if executor is not None:
        work = _in_executor(executor, guarded)
    else:
        work = asyncio.ensure_future(anyio.to_thread.run_sync(guarded, limiter=limiter))
    try:
        await asyncio.wait({work})
    except asyncio.CancelledError:
        if not gate.leave():  # it never began, and now never will
            work.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, not logged
            work.cancel()
            raise
        # It runs: the cancel waits for it, then is raised as it came (anyio's cancel scope, move_on_after or
        # fail_after, knows its own by it and ends there). Shielded meanwhile: such a scope sends its cancel again
        # at every turn of the loop while a task stays in it, and caught each time the loop spun till the work's end.
        with anyio.CancelScope(shield=True):
            while not work.done():
                try:
                    await asyncio.wait({work})
                except asyncio.CancelledError:  # another asyncio cancel: the one raised is the first
                    continue
        raise
    return work.result()


class WorkShares:
    """Worker threads by party: each party's calls of :meth:`run` take at most ``per_party`` threads at once, the
    rest waiting their turn in order, in the process's work threads (:func:`work_executor`, below the engine's OS
    priority). Without it all shared anyio's pool of 40, first come first served: one caller's flood of large bodies
    (each decoded in a thread, the interpreter's lock held for most of it) left another's one call waiting behind
    forty. A party's entry lives while one of its calls does."""

    def __init__(self, per_party: int | None = None) -> None:
        per_party = WORK_THREADS_PER_PARTY if per_party is None else per_party  # the module's, read when made
        if per_party < 1:
            raise ValueError(f"per_party must be >= 1, not {per_party}")
        self.per_party = per_party
        self._parties: dict[Hashable, tuple[anyio.CapacityLimiter, list[int]]] = {}

    def __len__(self) -> int:
        """The parties with a call under way or waiting."""
        return len(self._parties)

    def running(self, party: Hashable) -> int:
        """How many of ``party``'s calls run in a worker thread now."""
        entry = self._parties.get(party)
        return 0 if entry is None else int(entry[0].borrowed_tokens)

    async def run(self, party: Hashable | None, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` as :func:`run_sync_to_end` runs it, in a work thread once one of ``party``'s places is free
        (None: no party, a work thread as they come). A cancel while it waits for a place ends the call, ``fn`` never run."""
        if party is None:
            return await run_sync_to_end(fn, *args, executor=work_executor())
        entry = self._parties.get(party)
        if entry is None:
            entry = self._parties[party] = (anyio.CapacityLimiter(self.per_party), [0])
        limiter, users = entry
        users[0] += 1
        token = object()  # a place per call, not per task (anyio lends a task one place of a limiter)
        try:
            await limiter.acquire_on_behalf_of(token)
            try:
                return await run_sync_to_end(fn, *args, executor=work_executor())
            finally:
                limiter.release_on_behalf_of(token)
        finally:
            users[0] -= 1
            if not users[0]:
                del self._parties[party]
