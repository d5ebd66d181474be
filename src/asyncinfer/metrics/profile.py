"""``engine.profile(steps=N, path=...)``: the next N engine steps under ``torch.profiler``.

The step hook (:mod:`asyncinfer.metrics.engine_metrics`) ticks the armed
:class:`StepProfiler` on the engine thread after every step: the first tick starts
the profiler, the N+1-th stops it, so exactly N whole steps (and the engine
thread's work between them) are inside. The loop then writes the Chrome trace
(``trace.json``, for chrome://tracing or Perfetto) and the top-ops table
(``top_ops.txt``) in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from asyncinfer.errors import InvalidParameterError
from asyncinfer.plain import plain_value


@dataclass(frozen=True)
class ProfileResult:
    """What :meth:`AsyncEngine.profile` wrote: the Chrome trace, the top-ops table (also as text)."""

    steps: int
    trace_path: Path
    table_path: Path
    table: str


class StepProfiler:
    """Counts steps on the engine thread; hands the stopped profiler to the event loop.

    ``tick`` (engine thread) and ``abandon`` (the loop, when the caller went away or
    the engine stopped) hold one lock, so the torch profiler is started and stopped once.
    """

    def __init__(self, steps: int, device: torch.device, loop: asyncio.AbstractEventLoop,
                 done: asyncio.Future[Any]) -> None:
        self.steps = steps
        self._device = device
        self._loop = loop
        self._done = done
        self._profiler: Any = None
        self._seen = 0
        self._lock = threading.Lock()
        self.finished = False  # stopped (complete or abandoned): later ticks only unhook it

    def tick(self) -> bool:
        """After a step (engine thread). Returns True once the profile is complete (or abandoned)."""
        with self._lock:
            if self.finished:
                return True
            if self._profiler is None:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if self._device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._profiler = torch.profiler.profile(activities=activities)
                self._profiler.start()
                return False
            self._seen += 1
            if self._seen < self.steps:
                return False
            self._profiler.stop()
            self.finished = True
        profiler = self._profiler
        try:
            self._loop.call_soon_threadsafe(lambda: None if self._done.done() else self._done.set_result(profiler))
        except RuntimeError:  # the loop is closed: nobody waits
            pass
        return True

    def abandon(self) -> None:
        """Stop now (any thread): a torch profiler already started is stopped, its trace dropped."""
        with self._lock:
            if not self.finished and self._profiler is not None:
                self._profiler.stop()
            self.finished = True


def _write(profiler: Any, steps: int, path: Path, device: torch.device) -> ProfileResult:
    trace = path / "trace.json"
    profiler.export_chrome_trace(str(trace))
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort_by, row_limit=25)
    table_path = path / "top_ops.txt"
    table_path.write_text(f"{steps} engine steps, sorted by {sort_by}\n{table}\n", encoding="utf-8")
    return ProfileResult(steps, trace, table_path, table)


#: The most steps one profile records: the profiler keeps every op of every step in memory until it writes them.
MAX_PROFILE_STEPS = 10_000


async def profile_steps(metrics: Any, link: Any, steps: int, path: str | os.PathLike[str]) -> ProfileResult:
    """Arm a profile of the next ``steps`` steps, wait for them (``link``: the engine's
    :class:`~asyncinfer.engine_thread.ThreadLink`, which fails the wait if the engine stops), write the files."""
    steps = plain_value(steps)  # the int it holds: a subclass's comparisons may pose as in range
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_PROFILE_STEPS:
        raise InvalidParameterError("steps", steps, f"an integer in [1, {MAX_PROFILE_STEPS}]")
    if metrics.profiler is not None:
        raise InvalidParameterError("profile", "another profile", "one profile at a time")
    where = await anyio.to_thread.run_sync(_directory, path)  # a bad path fails now, not after the steps
    if metrics.profiler is not None:  # armed by a call that started meanwhile: one profile at a time
        raise InvalidParameterError("profile", "another profile", "one profile at a time")
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    metrics.install_hooks()
    metrics.profiler = armed = StepProfiler(steps, metrics.device, loop, done)
    try:
        await link.wait_for(done)
    finally:
        armed.abandon()  # the caller went away or the engine stopped (a complete profile: nothing to do)
        if metrics.profiler is armed:
            metrics.profiler = None  # the slot is free at once, not at the next step
    profiler = done.result()
    return await anyio.to_thread.run_sync(_write, profiler, steps, where, metrics.device)


def _directory(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory that exists and can be written (created if missing).

    Raises:
        InvalidParameterError: an empty path, a file, one with a NUL, or one that cannot be created or written.
    """
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str) or not os.fspath(path):
        raise InvalidParameterError("path", path, "a non-empty directory path")  # a path of bytes too: Path() refuses it
    where = Path(path)
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        allowed = f"a directory that can be created ({exc.strerror})"
        raise InvalidParameterError("path", os.fspath(path), allowed) from None
    except ValueError:  # a NUL in the path, which no file system takes (os's own ValueError before)
        raise InvalidParameterError("path", os.fspath(path), "a directory path without NUL characters") from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise InvalidParameterError("path", os.fspath(path), "a directory this process can write")
    return where
