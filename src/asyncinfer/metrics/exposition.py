"""The Prometheus face of ``engine.metrics``: its registry renders one snapshot per scrape.

Names follow Prometheus' conventions: the ``asyncinfer_`` prefix, base units in the
name (``_seconds``, ``_bytes``, ``_ratio``), ``_total`` on counters (added by the
client library), and a ``model`` label on every per-model figure. Every family is
yielded at every scrape, with no sample when it does not apply (a CUDA gauge on a CPU),
so the names a dashboard may query are always described. :data:`METRICS` is the list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from asyncinfer.metrics.types import HistogramSnapshot, MetricsSnapshot, ModelMetrics

if TYPE_CHECKING:
    from asyncinfer.metrics.engine_metrics import EngineMetrics

Read = Callable[[ModelMetrics], Any]

# (name without the prefix, help, what a model's figure is) -- counters, then gauges, then histograms
COUNTERS: tuple[tuple[str, str, Read], ...] = (
    ("prompt_tokens", "Prompt tokens of requests whose prompt was computed", lambda m: m.prompt_tokens),
    ("generation_tokens", "Tokens generated", lambda m: m.generation_tokens),
    ("preemptions", "Requests preempted for lack of KV blocks", lambda m: m.preemptions),
    ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
     lambda m: m.prefix_cache_queried_tokens),
    ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", lambda m: m.prefix_cache_hit_tokens),
    ("kv_cow_copies", "KV blocks copied on write", lambda m: m.kv_cow_copies),
    ("kv_evictions", "Cached prefix blocks evicted", lambda m: m.kv_evictions),
    ("kv_window_releases", "KV blocks given back for lying wholly before a request's sliding window",
     lambda m: m.kv_window_releases),
    ("decode_bytes_read", "Bytes decode-only steps read: weights plus the KV cache attended over",
     lambda m: m.decode_bytes_read),
    ("decode_step_seconds", "Seconds spent in decode-only steps", lambda m: m.decode_seconds),
    ("embedding_calls", "embed() calls", lambda m: m.embedding_calls),
    ("embedding_texts", "Texts embedded", lambda m: m.embedding_texts),
    ("embedding_batches", "Embedding forward passes", lambda m: m.embedding_batches),
    ("embedding_tokens", "Real tokens embedded", lambda m: m.embedding_tokens),
)
#: The counters the metrics record themselves (nothing with ``enable_metrics=False``); the others are read live.
RECORDED = frozenset({"prompt_tokens", "generation_tokens", "decode_bytes_read", "decode_step_seconds"})
LABELLED_COUNTERS: tuple[tuple[str, str, str, Read], ...] = (
    ("requests", "Finished requests by finish reason", "finish_reason", lambda m: m.requests),
    ("swaps", "Model swaps by outcome (ok, refused, failed, cancelled)", "outcome", lambda m: m.swaps),
    ("rejected_requests", "Requests refused at admission by reason (invalid, overloaded)", "reason",
     lambda m: m.rejected),
)
# The labelled counters that also count calls naming a model the engine does not hold: those are
# rendered under this one fixed label value, never under the caller's name (unbounded cardinality).
UNKNOWN_MODEL_LABEL = ""
UNKNOWN_MODEL_COUNTS: dict[str, Callable[[MetricsSnapshot], dict[str, int]]] = {
    "swaps": lambda s: s.unknown_model_swaps,
    "rejected_requests": lambda s: s.unknown_model_rejected,
}
GAUGES: tuple[tuple[str, str, Read], ...] = (
    ("requests_running", "Requests in the running set", lambda m: m.running),
    ("requests_waiting", "Requests waiting to be scheduled", lambda m: m.waiting),
    ("kv_blocks", "KV cache blocks in the pool (current version)", lambda m: m.kv_blocks),
    ("kv_blocks_used", "KV cache blocks held by requests", lambda m: m.kv_blocks_used),
    ("kv_blocks_cached_free", "Free KV blocks that still hold a cached prefix", lambda m: m.kv_blocks_cached_free),
    ("kv_usage_ratio", "Fraction of KV blocks in use", lambda m: m.kv_usage),
    ("model_versions_live", "Versions of the model loaded (2 during an overlap swap)", lambda m: m.versions_live),
    ("decode_bandwidth_bytes_per_second", "Bytes per second the latest decode-only step read",
     lambda m: m.last_decode_bandwidth),
    ("decode_bandwidth_utilization_ratio", "The latest decode-only step's bandwidth over the device's, at most 1",
     lambda m: m.last_decode_bandwidth_utilization),
)
HISTOGRAMS: tuple[tuple[str, str, Read], ...] = (
    ("time_to_first_token_seconds", "Arrival to first token", lambda m: m.ttft),
    ("time_per_output_token_seconds", "Per request: first token to end over tokens after the first",
     lambda m: m.tpot),
    ("e2e_request_latency_seconds", "Arrival to the request's end", lambda m: m.e2e_latency),
    ("request_queue_time_seconds", "Arrival to first scheduled", lambda m: m.queue_time),
    ("request_prompt_tokens", "Prompt length of finished requests", lambda m: m.prompt_len),
    ("request_generation_tokens", "Tokens generated per finished request (all samples)", lambda m: m.output_len),
    ("step_tokens", "Tokens computed per step", lambda m: m.step_tokens),
    ("step_sequences", "Requests per step", lambda m: m.step_sequences),
    ("step_duration_seconds", "Wall time of one engine step", lambda m: m.step_duration),
    ("step_mask_seconds", "Per step that sampled structured requests: seconds on their grammar masks",
     lambda m: m.step_mask_duration),
)
ENGINE_GAUGES: tuple[tuple[str, str, str, Callable[[MetricsSnapshot], Any]], ...] = (
    ("memory_bandwidth_bytes_per_second", "The device's memory bandwidth (measured at start-up or given)",
     "device", lambda s: s.memory_bandwidth),
    ("device_memory_allocated_bytes", "CUDA memory allocated by torch", "device", lambda s: s.device_memory_allocated),
    ("device_memory_reserved_bytes", "CUDA memory reserved by torch's allocator", "device",
     lambda s: s.device_memory_reserved),
    ("device_memory_total_bytes", "CUDA device memory", "device", lambda s: s.device_memory_total),
    ("device_utilization_ratio", "NVML GPU utilisation (nvidia-ml-py)", "device", lambda s: s.device_utilization),
)
ENGINE_STATES = ("created", "running", "closing", "closed", "dead")

PREFIX = "asyncinfer_"


def metric_names() -> list[str]:
    """Every family the engine's collector describes (without ``_total``/``_bucket`` suffixes)."""
    names = [n for n, *_ in (*COUNTERS, *LABELLED_COUNTERS, *GAUGES, *HISTOGRAMS, *ENGINE_GAUGES)]
    return [PREFIX + n for n in (*names, "engine_state", "requests_in_flight")]


class SnapshotCollector:
    """Takes one snapshot per scrape and renders it."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self._metrics.snapshot()
        generators = [m for m in snap.models.values() if m.kind == "generate"]
        embedders = [m for m in snap.models.values() if m.kind == "embed"]
        # With enable_metrics=False the figures the metrics record are described without a sample (no data), not as
        # zeros that read as a server answering nobody; those read live (gauges, KV and embedding counts) stay.
        recorded = generators if self._metrics.enabled else []
        for name, doc, read in COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model"])
            for m in embedders if name.startswith("embedding_") else recorded if name in RECORDED else generators:
                family.add_metric([m.name], float(read(m)))
            yield family
        for name, doc, label, read in LABELLED_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model", label])
            for m in recorded:
                for key, value in read(m).items():
                    family.add_metric([m.name, key], float(value))
            unknown = UNKNOWN_MODEL_COUNTS.get(name)
            counts = unknown(snap) if unknown is not None else {}
            if any(counts.values()):  # calls that named no model the engine holds: one fixed label
                for key, value in counts.items():
                    family.add_metric([UNKNOWN_MODEL_LABEL, key], float(value))
            yield family
        for name, doc, read in GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model"])
            for m in snap.models.values() if name == "model_versions_live" else generators:
                value = read(m)
                if value is not None and (m.versions_live or name == "model_versions_live"):
                    family.add_metric([m.name], float(value))
            yield family
        for name, doc, read in HISTOGRAMS:
            family = HistogramMetricFamily(PREFIX + name, doc, labels=["model"])
            for m in recorded:
                hist: HistogramSnapshot | None = read(m)
                if hist is not None:
                    buckets = [(_le(b), float(c)) for b, c in hist.cumulative()]
                    family.add_metric([m.name], buckets, hist.sum)
            yield family
        for name, doc, label, read_engine in ENGINE_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
            value = read_engine(snap)
            if value is not None:
                family.add_metric([snap.device], float(value))
            yield family
        state = GaugeMetricFamily(PREFIX + "engine_state", "1 for the engine's lifecycle state", labels=["state"])
        for s in ENGINE_STATES:
            state.add_metric([s], 1.0 if snap.state == s else 0.0)
        yield state
        yield GaugeMetricFamily(PREFIX + "requests_in_flight", "Generation requests in the engine",
                                value=snap.requests_in_flight)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def build_registry(metrics: EngineMetrics) -> CollectorRegistry:
    """A registry of its own: the engine's figures and the process's (memory, CPU, open files)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(metrics))
    ProcessCollector(registry=registry)
    return registry


_NOT_ALLOWED = b"405 Method Not Allowed: GET or HEAD only\n"


def asgi_app(engine: Any) -> Any:
    """An ASGI app serving ``engine``'s metrics: ``app.mount("/metrics", asgi_app(engine))``.

    GET serves the exposition, HEAD its headers alone, any other method is a 405. Run by a
    server directly (``uvicorn``), it completes the lifespan protocol's startup and shutdown
    (it owns nothing: the engine's own lifecycle stays the caller's).
    """
    from prometheus_client import make_asgi_app

    serve = make_asgi_app(registry=engine.metrics.registry)

    async def app(scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[dict[str, Any]], Any]) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] != "http":
            raise ValueError(f"asyncinfer.metrics.asgi_app serves HTTP, not a {scope['type']!r} scope")
        elif scope["method"] == "GET":
            await serve(scope, receive, send)
        elif scope["method"] == "HEAD":
            await serve({**scope, "method": "GET"}, receive, _headers_only(send))
        else:
            await send({"type": "http.response.start", "status": 405,
                        "headers": [(b"allow", b"GET, HEAD"), (b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(_NOT_ALLOWED)).encode())]})
            await send({"type": "http.response.body", "body": _NOT_ALLOWED})

    return app


async def _lifespan(receive: Callable[[], Any], send: Callable[[dict[str, Any]], Any]) -> None:
    """The lifespan protocol: nothing to start or stop, each event acknowledged."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _headers_only(send: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """``send`` with every response body emptied (the answer to a HEAD request)."""

    async def send_headers(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_headers


def exposition(engine: Any) -> bytes:
    """``engine``'s metrics in Prometheus' text format."""
    return generate_latest(engine.metrics.registry)
