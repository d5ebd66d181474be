"""What the machine can do and what it holds: memory bandwidth, device memory, utilisation, RSS.

The roofline gauge divides each decode step's bytes by the device's memory
bandwidth. :func:`measure_memory_bandwidth` measures that once at engine
start-up by reading ``nbytes`` once (a sum over them, best of a few runs); the
``memory_bandwidth`` engine option skips it. Reading a buffer once is what a
decode step does to its weights, so the figure is the attainable read rate, not
the datasheet's peak, which is the fairer denominator. (A copy, as measured
before, counts the bytes read and written but not the cache-line reads its
writes cost on a CPU: a decode step that only reads ran faster than that figure.)

The CUDA figures are torch's allocator (allocated, reserved) and, when the
optional ``nvidia-ml-py`` package is installed, NVML's utilisation. Nothing here
keeps process-wide state.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

PROBE_BYTES = 64 * 1024**2


def measure_memory_bandwidth(device: torch.device, nbytes: int = PROBE_BYTES, repeats: int = 3) -> float:
    """Bytes per second one read of ``nbytes`` on ``device`` takes (a sum over them), best of ``repeats``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # [n]
    best = float("inf")
    for run in range(repeats + 1):  # the first run pages the buffer in; it is not counted
        _sync(device)
        start = time.perf_counter()
        src.sum()
        _sync(device)
        if run:
            best = min(best, time.perf_counter() - start)
    nbytes = src.numel() * 4
    del src
    if device.type == "cuda":  # give the buffers back: the KV planner reads the device's free memory
        torch.cuda.empty_cache()
    return nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def process_rss_bytes() -> int:
    """The process's resident set size (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def cuda_memory(device: torch.device) -> tuple[int, int, int] | None:
    """``(allocated, reserved, total)`` bytes of torch's allocator on a CUDA ``device``; None on a CPU."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), int(total)


class Nvml:
    """NVML's utilisation of one CUDA device, through ``nvidia-ml-py`` (None when it is missing)."""

    def __init__(self, device: torch.device) -> None:
        self._handle: Any = None
        self._nvml: Any = None
        if device.type != "cuda":
            return
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no package, no driver, no permission: no utilisation gauge
            self._handle = None

    def utilization(self) -> float | None:
        """The fraction of the last sample period in which a kernel ran (NVML's ``gpu`` rate)."""
        if self._handle is None:
            return None
        try:
            return self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
        except Exception:  # noqa: BLE001 - a lost device reads as unknown, never as an error in a scrape
            return None
