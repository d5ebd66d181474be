"""Ctrl-C held back while the command imports torch (see :func:`deferred_interrupts`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run the block with Ctrl-C (SIGINT) held back, then raise it as ``KeyboardInterrupt``.

    A ``KeyboardInterrupt`` raised in the middle of an import runs through C extensions' code
    (torch's pybind11 module set-up), where it can abort the process, be swallowed, or make
    Python end by SIGINT after a handler caught it. Held back, it is raised once the block is
    done, in plain Python. Only in the main thread while Python's own handler is installed;
    elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt
