"""asyncinfer: an asyncio LLM inference engine you embed in-process.

    from asyncinfer import AsyncEngine, SamplingParams

    engine = AsyncEngine.from_pretrained()          # None -> SmolLM2-135M-Instruct
    async with engine:
        out = await engine.generate("Hello", SamplingParams(max_tokens=32))

Importing the package is cheap: the errors are imported with it, every other name on first
use (PEP 562), so ``asyncinfer``'s command and ``python -m asyncinfer`` run their own code,
Ctrl-C handling included, before torch is imported.
"""

from __future__ import annotations

import importlib

from asyncinfer.errors import (
    AsyncInferError,
    ConfigurationError,
    EngineClosedError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    MaxTokensOverContextError,
    ModelChangedError,
    ModelLoadError,
    PromptTooLongError,
    RequestAbortedError,
    RequestFailedError,
    RequestStalledError,
    SwapError,
    WrongEventLoopError,
)

TYPE_CHECKING = False  # typing's own import (re, enum) costs a Ctrl-C window before the CLI's guard
if TYPE_CHECKING:
    from typing import Any

    from asyncinfer.cache.kv_manager import KVCacheStats
    from asyncinfer.config import EngineConfig
    from asyncinfer.core import StepStats
    from asyncinfer.embedding import EmbeddingConfig, EmbeddingPlan, EmbeddingStats
    from asyncinfer.engine import AsyncEngine, EngineState
    from asyncinfer.history import trim_messages
    from asyncinfer.holder import ModelVersionInfo
    from asyncinfer.memory import MemoryPlan
    from asyncinfer.metrics import (
        EngineMetrics,
        HistogramSnapshot,
        MemoryReport,
        MetricsSnapshot,
        ModelMemory,
        ModelMetrics,
        ProfileResult,
    )
    from asyncinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, StreamDelta
    from asyncinfer.sampling_params import SamplingParams
    from asyncinfer.structured import StructuredOutput
    from asyncinfer.threads import on_own_thread

# Every public name but the errors: the module it is imported from on first use.
_LAZY: dict[str, str] = {
    "KVCacheStats": "asyncinfer.cache.kv_manager",
    "EngineConfig": "asyncinfer.config",
    "StepStats": "asyncinfer.core",
    "EmbeddingConfig": "asyncinfer.embedding",
    "EmbeddingPlan": "asyncinfer.embedding",
    "EmbeddingStats": "asyncinfer.embedding",
    "AsyncEngine": "asyncinfer.engine",
    "EngineState": "asyncinfer.engine",
    "trim_messages": "asyncinfer.history",
    "ModelVersionInfo": "asyncinfer.holder",
    "MemoryPlan": "asyncinfer.memory",
    "EngineMetrics": "asyncinfer.metrics",
    "HistogramSnapshot": "asyncinfer.metrics",
    "MemoryReport": "asyncinfer.metrics",
    "MetricsSnapshot": "asyncinfer.metrics",
    "ModelMemory": "asyncinfer.metrics",
    "ModelMetrics": "asyncinfer.metrics",
    "ProfileResult": "asyncinfer.metrics",
    "CompletionOutput": "asyncinfer.outputs",
    "Logprob": "asyncinfer.outputs",
    "RequestMetrics": "asyncinfer.outputs",
    "RequestOutput": "asyncinfer.outputs",
    "StreamDelta": "asyncinfer.outputs",
    "SamplingParams": "asyncinfer.sampling_params",
    "StructuredOutput": "asyncinfer.structured",
    "on_own_thread": "asyncinfer.threads",
}

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "AsyncInferError",
    "CompletionOutput",
    "ConfigurationError",
    "EmbeddingConfig",
    "EmbeddingPlan",
    "EmbeddingStats",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineMetrics",
    "EngineOverloadedError",
    "EngineState",
    "HistogramSnapshot",
    "InvalidParameterError",
    "KVCacheStats",
    "Logprob",
    "MaxTokensOverContextError",
    "MemoryPlan",
    "MemoryReport",
    "MetricsSnapshot",
    "ModelChangedError",
    "ModelLoadError",
    "ModelMemory",
    "ModelMetrics",
    "ModelVersionInfo",
    "ProfileResult",
    "PromptTooLongError",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStalledError",
    "SamplingParams",
    "StepStats",
    "StreamDelta",
    "StructuredOutput",
    "SwapError",
    "WrongEventLoopError",
    "__version__",
    "on_own_thread",
    "trim_messages",
]


def __getattr__(name: str) -> Any:
    """A public name (its module imported on first use), else a submodule: ``asyncinfer.metrics``
    after a bare ``import asyncinfer`` works as it did when the package imported everything."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next look-up is a plain attribute
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
