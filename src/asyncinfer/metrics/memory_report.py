"""``engine.memory_report()``: where the memory is, to tell a leak from a cache.

A leak shows as KV blocks held (``used_blocks``) with no request in flight, or as
process memory (RSS on a CPU, torch's allocated bytes on CUDA) that grows across
idle periods. A cache shows as ``cached_free_blocks``: free blocks that still hold a
prefix, reusable by any allocation. The weights and the KV pool are fixed at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncinfer.errors import AsyncInferError
from asyncinfer.memory import MiB
from asyncinfer.metrics.device import cuda_memory, process_rss_bytes


@dataclass(frozen=True)
class ModelMemory:
    """One live model version's memory: weights, KV pool and how its blocks are held."""

    name: str
    kind: str  # "generate" or "embed"
    version_id: int
    state: str  # "current" or "draining"
    weight_bytes: int
    kv_bytes: int  # the KV pool (0 for an embedding model)
    num_blocks: int
    used_blocks: int  # held by requests
    cached_free_blocks: int  # free, still holding a cached prefix
    requests_in_flight: int


@dataclass(frozen=True)
class MemoryReport:
    """``engine.memory_report()``: the engine's models and the process's memory now.

    ``allocated_bytes``/``reserved_bytes`` are torch's CUDA allocator's (None on a CPU);
    ``process_rss_bytes`` is the process's resident memory (Linux), on any device.
    """

    device: str
    models: tuple[ModelMemory, ...]
    requests_in_flight: int
    process_rss_bytes: int
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None

    @property
    def held_blocks_without_requests(self) -> int:
        """KV blocks held by versions that have no request in flight: should always be 0 (else a leak)."""
        return sum(m.used_blocks for m in self.models if m.requests_in_flight == 0)

    def describe(self) -> str:
        lines = [(f"device {self.device}, {_in_flight(self.requests_in_flight)}, "
                  f"process RSS {self.process_rss_bytes / MiB:.1f} MiB")]
        if self.allocated_bytes is not None:
            lines.append(f"torch CUDA allocator: {self.allocated_bytes / MiB:.1f} MiB allocated, "
                         f"{(self.reserved_bytes or 0) / MiB:.1f} MiB reserved")
        for m in self.models:
            line = f"{m.name} v{m.version_id} ({m.kind}, {m.state}): weights {m.weight_bytes / MiB:.1f} MiB"
            if m.kind == "generate":
                line += (f", KV pool {m.kv_bytes / MiB:.1f} MiB: {m.used_blocks}/{m.num_blocks} blocks held, "
                         f"{m.cached_free_blocks} free blocks caching prefixes")
            lines.append(line + f", {_in_flight(m.requests_in_flight)}")
        return "\n".join(lines)


def _in_flight(count: int) -> str:
    """``1 request in flight``, ``2 requests in flight``."""
    return f"{count} request{'' if count == 1 else 's'} in flight"


def memory_report(engine: Any, live_versions: list[tuple[str, Any]]) -> MemoryReport:
    """The report of ``engine``; ``live_versions``: its generator versions as ``(name, ModelVersion)``."""
    by_id = {version.version_id: version for _, version in live_versions}
    models = []
    for info in engine.model_info():
        plan = info.memory_plan
        if info.kind == "embed":
            models.append(ModelMemory(info.name, "embed", info.version_id, info.state, plan.weight_bytes, 0, 0, 0, 0,
                                      info.requests_in_flight))
            continue
        version = by_id.get(info.version_id)
        core = None if version is None else version.core
        try:
            stats = core.kv.stats() if core is not None else None
        except AsyncInferError:
            stats = None
        models.append(ModelMemory(
            info.name, "generate", info.version_id, info.state, plan.weight_bytes, plan.kv_bytes, plan.num_blocks,
            stats.used_blocks if stats else 0, stats.cached_free_blocks if stats else 0, info.requests_in_flight,
        ))
    cuda = cuda_memory(engine.config.device)
    return MemoryReport(
        device=str(engine.config.device),
        models=tuple(models),
        requests_in_flight=engine.num_unfinished_requests,
        process_rss_bytes=process_rss_bytes(),
        allocated_bytes=None if cuda is None else cuda[0],
        reserved_bytes=None if cuda is None else cuda[1],
    )
