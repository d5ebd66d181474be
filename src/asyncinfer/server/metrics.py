"""``/metrics``: the engine's own registry (``engine.metrics.registry``) plus the HTTP layer's answers.

The engine's figures (requests, tokens, latencies, steps, KV cache, roofline, the
process's memory and CPU) come from its registry, rendered at scrape time
(docs/monitoring/README.md lists them); the router adds its count of answers by
route and status. Each router has its own registry and each engine its own, so
two apps in one process never mix their figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from asyncinfer.engine import AsyncEngine


class EngineCollector:
    """The engine's registry, read each time Prometheus scrapes (the engine may be built after the router)."""

    def __init__(self, engine: Callable[[], AsyncEngine]) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        yield from self._engine().metrics.registry.collect()


class AnswersCollector:
    """The HTTP layer's answers by route and status."""

    def __init__(self, answers: Counter[tuple[str, int]]) -> None:
        self._answers = answers

    def collect(self) -> Iterator[Metric]:
        answers = CounterMetricFamily("asyncinfer_http_responses", "HTTP answers by route and status",
                                      labels=["route", "status"])
        for (route, status), count in sorted(self._answers.items()):
            answers.add_metric([route, str(status)], count)
        yield answers


def metrics_registry(engine: Callable[[], AsyncEngine], answers: Counter[tuple[str, int]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    registry.register(AnswersCollector(answers))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
