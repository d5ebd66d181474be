"""Torch work that must not outlive its thread: :func:`on_own_thread`.

PyTorch's CPU kernels split their work with OpenMP. The OpenMP runtime torch ships
(GNU libgomp) keeps a team of worker threads for every thread that has run a parallel
region, for as long as that thread lives. Once the threads it manages outnumber the
CPUs, its workers stop spinning between regions and sleep instead, and every parallel
region on any thread then waits for a wake-up. On a 2-core machine that is one team
beyond the engine thread's: a model loaded on the caller's thread (which lives on)
made every decode step of the engine thread about twice as slow
(``benchmarks/threads.py`` measures it; docs/formats.md has the figures).

So loading (weights, packing, warm-up) runs on a thread of its own that ends with the
load, and its team ends with it; the engine thread is then the only one with a team.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[..., T], *args: Any, name: str = "asyncinfer-load", **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` on a new thread that ends with the call; its result, or its exception.

    The caller blocks until the call ends. A ``KeyboardInterrupt`` in the caller while it waits
    leaves the call to finish on its own (a daemon thread: it does not keep the process alive).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, re-raised there
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
