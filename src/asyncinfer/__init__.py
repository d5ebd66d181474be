"""asyncinfer: an asyncio LLM inference engine you embed in-process.

    from asyncinfer import AsyncEngine, SamplingParams

    engine = AsyncEngine.from_pretrained()          # None -> SmolLM2-135M-Instruct
    async with engine:
        out = await engine.generate("Hello", SamplingParams(max_tokens=32))
"""

from asyncinfer.cache.kv_manager import KVCacheStats
from asyncinfer.config import EngineConfig
from asyncinfer.core import StepStats
from asyncinfer.embedding import EmbeddingConfig, EmbeddingPlan, EmbeddingStats
from asyncinfer.engine import AsyncEngine, EngineState
from asyncinfer.errors import (
    AsyncInferError,
    ConfigurationError,
    EngineClosedError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    ModelLoadError,
    RequestAbortedError,
    RequestFailedError,
    RequestStalledError,
    SwapError,
    WrongEventLoopError,
)
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

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "AsyncInferError",
    "CompletionOutput",
    "ConfigurationError",
    "EngineClosedError",
    "EmbeddingConfig",
    "EmbeddingPlan",
    "EmbeddingStats",
    "EngineConfig",
    "EngineMetrics",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineState",
    "HistogramSnapshot",
    "InvalidParameterError",
    "KVCacheStats",
    "Logprob",
    "MemoryPlan",
    "MemoryReport",
    "MetricsSnapshot",
    "ModelMemory",
    "ModelMetrics",
    "ModelLoadError",
    "ModelVersionInfo",
    "ProfileResult",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStalledError",
    "SamplingParams",
    "StepStats",
    "StreamDelta",
    "SwapError",
    "WrongEventLoopError",
    "__version__",
    "trim_messages",
]
