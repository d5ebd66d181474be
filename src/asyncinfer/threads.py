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
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

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


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in ``thread`` at its next Python instruction (CPython; elsewhere nothing)."""
    try:
        import ctypes

        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    except (ImportError, AttributeError):  # not CPython: the call runs to its end
        return
    if thread.ident is not None:
        set_async_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type))


def _wait_uninterrupted(done: threading.Event, thread: threading.Thread) -> None:
    """Wait until the call is done (or its thread gone), absorbing further Ctrl-Cs: the caller
    re-raises the first one."""
    while not done.is_set() and thread.is_alive():
        try:
            done.wait(0.05)
        except KeyboardInterrupt:
            continue
