"""``/metrics``: the engine's figures in Prometheus' text format, read at scrape time.

Until the engine grows its own metrics, these are what it reports already: the
KV cache (``kv_stats``), the step counters (``step_stats``), the embedding
batchers (``embedding_stats``), the requests in flight, plus the HTTP layer's
own count of answers by route and status, and the process's memory and CPU time. Each router has its own registry
(nothing process-global), so two apps in one process never mix their figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncinfer.engine import AsyncEngine
from asyncinfer.errors import AsyncInferError

# (metric name, help, KVCacheStats / StepStats / EmbeddingStats attribute)
_KV_GAUGES = (
    ("asyncinfer_kv_blocks", "KV cache blocks in the pool", "num_blocks"),
    ("asyncinfer_kv_blocks_used", "KV cache blocks held by requests", "used_blocks"),
    ("asyncinfer_kv_blocks_cached_free", "Free KV blocks that still hold a cached prefix", "cached_free_blocks"),
    ("asyncinfer_kv_usage_ratio", "Fraction of KV blocks in use", "usage"),
)
_KV_COUNTERS = (
    ("asyncinfer_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", "prefix_queries"),
    ("asyncinfer_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", "prefix_hits"),
    ("asyncinfer_kv_preemptions", "Requests preempted for lack of KV blocks", "preemptions"),
    ("asyncinfer_kv_cow_copies", "KV blocks copied on write", "cow_copies"),
    ("asyncinfer_kv_evictions", "Cached prefix blocks evicted", "evictions"),
)
_STEP_COUNTERS = (
    ("asyncinfer_steps", "Engine steps run (current model version)", "steps"),
    ("asyncinfer_prefill_tokens", "Prompt tokens computed (current model version)", "prefill_tokens"),
    ("asyncinfer_decode_tokens", "Tokens decoded (current model version)", "decode_tokens"),
)
_EMBED_COUNTERS = (
    ("asyncinfer_embedding_calls", "embed() calls", "num_calls"),
    ("asyncinfer_embedding_texts", "Texts embedded", "num_texts"),
    ("asyncinfer_embedding_batches", "Embedding forward passes", "num_batches"),
    ("asyncinfer_embedding_tokens", "Real tokens embedded", "num_tokens"),
)


class EngineCollector:
    """Reads the engine each time Prometheus scrapes."""

    def __init__(self, engine: Callable[[], AsyncEngine], answers: Counter[tuple[str, int]]) -> None:
        self._engine = engine
        self._answers = answers

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        yield GaugeMetricFamily("asyncinfer_requests_in_flight", "Generation requests in the engine",
                                value=engine.num_unfinished_requests)
        families = {name: GaugeMetricFamily(name, doc, labels=["model"]) for name, doc, _ in _KV_GAUGES}
        families |= {name: CounterMetricFamily(name, doc, labels=["model"])
                     for name, doc, _ in (*_KV_COUNTERS, *_STEP_COUNTERS, *_EMBED_COUNTERS)}
        for name, kind in dict.fromkeys((info.name, info.kind) for info in engine.model_info()):
            try:
                if kind == "embed":
                    self._add(families, _EMBED_COUNTERS, engine.embedding_stats(name), name)
                else:
                    kv = engine.kv_stats(name)
                    self._add(families, (*_KV_GAUGES, *_KV_COUNTERS), kv, name)
                    self._add(families, _STEP_COUNTERS, engine.step_stats(name), name)
            except AsyncInferError:  # removed, or between versions, while we read
                continue
        yield from families.values()
        answers = CounterMetricFamily("asyncinfer_http_responses", "HTTP answers by route and status",
                                      labels=["route", "status"])
        for (route, status), count in sorted(self._answers.items()):
            answers.add_metric([route, str(status)], count)
        yield answers

    @staticmethod
    def _add(families: dict[str, Metric], table: tuple[tuple[str, str, str], ...], stats: object, model: str) -> None:
        for name, _doc, attr in table:
            families[name].add_metric([model], float(getattr(stats, attr)))  # type: ignore[attr-defined]


def metrics_registry(engine: Callable[[], AsyncEngine], answers: Counter[tuple[str, int]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, answers))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, cpu seconds (Linux)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
