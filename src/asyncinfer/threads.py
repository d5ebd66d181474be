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


def on_own_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` on a new thread that ends with the call; its result, or its exception.

    Blocking: the caller waits for the call (in a coroutine, ``await asyncio.to_thread(on_own_thread,
    fn, ...)`` keeps the event loop running). The call sees the caller's context variables and its
    torch grad and inference modes (both are per thread in torch). A ``KeyboardInterrupt`` in the
    caller while it waits leaves the call to finish on its own (a daemon thread: it does not keep
    the process alive).
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

    def run() -> None:
        try:
            result.append(context.run(call))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, re-raised there
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
