"""See inside a running engine: ``engine.metrics``, ``engine.memory_report()``, ``engine.profile()``.

    snap = engine.metrics.snapshot()                 # plain data, no Prometheus needed
    snap.models["default"].ttft.quantile(0.99)
    app.mount("/metrics", asyncinfer.metrics.asgi_app(engine))   # FastAPI / Starlette, one line

The figures, their Prometheus names and how they are fed are in docs/monitoring/README.md;
the Prometheus side needs ``prometheus-client`` (the ``server`` extra).
"""

from __future__ import annotations

from typing import Any

from asyncinfer.metrics.engine_metrics import EngineMetrics, EngineObservability
from asyncinfer.metrics.memory_report import MemoryReport, ModelMemory
from asyncinfer.metrics.profile import ProfileResult
from asyncinfer.metrics.types import HistogramSnapshot, MetricsSnapshot, ModelMetrics

__all__ = [
    "EngineMetrics",
    "EngineObservability",
    "HistogramSnapshot",
    "MemoryReport",
    "MetricsSnapshot",
    "ModelMemory",
    "ModelMetrics",
    "ProfileResult",
    "asgi_app",
]


def asgi_app(engine: Any) -> Any:
    """An ASGI app serving ``engine``'s Prometheus metrics: ``app.mount("/metrics", asgi_app(engine))``."""
    from asyncinfer.metrics.exposition import asgi_app as make

    return make(engine)
