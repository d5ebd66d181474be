"""The figures ``engine.metrics.snapshot()`` returns, and the plain histogram behind them.

Plain data, no Prometheus: :class:`MetricsSnapshot` holds every figure the
``/metrics`` exposition shows (the exposition is rendered from it), so a program
without a Prometheus server reads the same numbers.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# Bucket upper bounds (the +Inf bucket is implicit). Seconds are wide on purpose: a CPU
# engine's TTFT is seconds, a GPU's milliseconds, and one set of buckets serves both.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: A step's structured-output mask time: tens of microseconds a row to tens of milliseconds a batch.
MASK_SECONDS_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(18))  # 1 .. 131072
SEQ_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 .. 4096

FINISH_REASONS = ("stop", "length", "abort", "error")
SWAP_OUTCOMES = ("ok", "refused", "failed", "cancelled")
REJECT_REASONS = ("invalid", "overloaded")


class Histogram:
    """Bucket counts, sum and count; written by one thread at a time (the metrics lock's holder)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum, self.count)


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram's buckets: ``counts[i]`` values were ``<= bounds[i]`` (and above the bound before);
    the last count is the values above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, values <= it)`` pairs, ending with ``(inf, count)``: Prometheus' buckets."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile interpolated inside its bucket, as PromQL's ``histogram_quantile``."""
        if not self.count:
            return None
        rank = q * self.count
        lower, below = 0.0, 0
        for bound, total in self.cumulative():
            if total >= rank:
                if math.isinf(bound):
                    return lower
                inside = total - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
            lower, below = bound, total
        return lower


@dataclass(frozen=True)
class ModelMetrics:
    """One named model's figures. Counters run since the engine was built (swaps keep them
    running); gauges are read at the snapshot; histograms cover every request or step so far.

    ``kind`` is "generate" or "embed"; an embedding model has only the ``embedding_*`` figures
    (and ``versions_live``). Bandwidth figures are of decode-only steps: ``decode_bytes_read``
    (weights + the KV cache they attended over) in ``decode_seconds``; the ``last_decode_*``
    gauges are the latest such step's (None before one ran).
    """

    name: str
    kind: str
    # counters
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    kv_cow_copies: int = 0
    kv_evictions: int = 0
    kv_window_releases: int = 0
    swaps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SWAP_OUTCOMES, 0))
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    decode_bytes_read: int = 0
    decode_seconds: float = 0.0
    embedding_calls: int = 0
    embedding_texts: int = 0
    embedding_batches: int = 0
    embedding_tokens: int = 0
    # gauges
    running: int = 0
    waiting: int = 0
    kv_blocks: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached_free: int = 0
    kv_usage: float = 0.0
    versions_live: int = 0
    last_decode_bandwidth: float | None = None  # bytes per second
    last_decode_bandwidth_utilization: float | None = None  # of MetricsSnapshot.memory_bandwidth, in [0, 1]
    # histograms
    ttft: HistogramSnapshot | None = None
    tpot: HistogramSnapshot | None = None
    e2e_latency: HistogramSnapshot | None = None
    queue_time: HistogramSnapshot | None = None
    prompt_len: HistogramSnapshot | None = None
    output_len: HistogramSnapshot | None = None
    step_tokens: HistogramSnapshot | None = None
    step_sequences: HistogramSnapshot | None = None
    step_duration: HistogramSnapshot | None = None
    step_mask_duration: HistogramSnapshot | None = None  # steps that sampled a structured request: their mask time

    @property
    def decode_bandwidth(self) -> float | None:
        """Mean bytes per second of every decode-only step so far."""
        return self.decode_bytes_read / self.decode_seconds if self.decode_seconds else None


@dataclass(frozen=True)
class MetricsSnapshot:
    """Every figure of ``engine.metrics`` at one moment (``engine.metrics.snapshot()``).

    ``models`` by name: every model the engine serves or served (a removed model keeps its
    counters). ``memory_bandwidth``: bytes per second of the device, measured at start-up
    (or the ``memory_bandwidth`` option); None for an engine without a generator. The
    ``device_*`` figures are CUDA's (None on a CPU); ``device_utilization`` needs
    ``nvidia-ml-py``. ``unknown_model_rejected`` (by reason) and ``unknown_model_swaps`` (by
    outcome) count the generation requests (``generate``, ``stream``) and swaps that named a model the engine
    does not hold (or named none on an engine without a generator; a refused ``embed()`` call is counted in no
    metric): they belong to no model, so no entry of ``models`` is made for
    them (/metrics renders them with the fixed label ``model=""``).
    """

    state: str
    device: str
    requests_in_flight: int
    models: dict[str, ModelMetrics]
    memory_bandwidth: float | None
    process_rss_bytes: int
    unknown_model_rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    unknown_model_swaps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SWAP_OUTCOMES, 0))
    device_memory_allocated: int | None = None
    device_memory_reserved: int | None = None
    device_memory_total: int | None = None
    device_utilization: float | None = None
