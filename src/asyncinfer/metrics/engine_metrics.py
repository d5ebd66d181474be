"""``engine.metrics``: one engine's figures, fed from both sides without slowing the step loop.

Three feeds, none of which does more than an append on the engine thread:

- **per step** (engine thread): each model version's core calls :meth:`EngineMetrics.watch`'s
  hook (``EngineCore.on_step``) after a step that ran; the hook appends one tuple (duration,
  sequences, tokens, bytes read for the roofline) to a deque. The loop drains the deque (a
  deque's append and popleft are atomic: no lock on the engine thread).
- **per output** (event loop): the outputs the engine thread hands to the loop pass through
  :meth:`EngineMetrics.outputs` (the stream table's observer) before they reach the request queues (first token,
  tokens, finish reason), with the requests :meth:`track`-ed when they were posted (the intake's
  observer). A request's queue time is its ``scheduled_time`` (which the engine sets when a step
  first schedules it) minus its ``arrival_time``, read at its first output.
- **per call** (event loop): refused requests (the intake's observer), swaps by outcome (the
  model changes' observer).

The engine hands its parts their observer when it builds them; nothing here wraps or
replaces a part of the engine.

Gauges (KV blocks, running/waiting requests, versions live, device memory) are read when a
snapshot is taken. :meth:`EngineMetrics.snapshot` gives all of it as plain data; the
Prometheus registry (:attr:`EngineMetrics.registry`) renders that same snapshot at scrape time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from asyncinfer.errors import AsyncInferError
from asyncinfer.metrics import types as t
from asyncinfer.metrics.device import Nvml, cuda_memory, measure_memory_bandwidth, process_rss_bytes
from asyncinfer.metrics.memory_report import MemoryReport
from asyncinfer.metrics.profile import ProfileResult, StepProfiler
from asyncinfer.metrics.requests import FinishedRequest, RequestTracker, log_finished
from asyncinfer.models.quant import decode_weight_bytes
from asyncinfer.threads import run_on_own_thread

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

    from asyncinfer.cache.kv_manager import KVCacheManager, KVCacheStats
    from asyncinfer.config import EngineConfig
    from asyncinfer.embedding import EmbeddingStats
    from asyncinfer.holder import ModelVersion, ModelVersionInfo
    from asyncinfer.outputs import CoreOutput
    from asyncinfer.request import Request

logger = logging.getLogger("asyncinfer")

_KV_COUNTERS = ("preemptions", "prefix_queries", "prefix_hits", "cow_copies", "evictions", "window_releases")


class EngineView(Protocol):
    """What the metrics read of their engine (``AsyncEngine``'s public calls), when a snapshot is taken."""

    @property
    def state(self) -> Any: ...  # an EngineState: its ``.value`` is the snapshot's state

    @property
    def num_unfinished_requests(self) -> int: ...

    def model_info(self) -> list[ModelVersionInfo]: ...

    def kv_stats(self, model: str | None = None) -> KVCacheStats: ...

    def embedding_stats(self, model: str | None = None) -> EmbeddingStats: ...

    def get_tokenizer(self, model: str | None = None) -> Any: ...


class _ModelFigures:
    """The counters and histograms of one named model (written under the metrics lock)."""

    def __init__(self) -> None:
        self.requests = dict.fromkeys(t.FINISH_REASONS, 0)
        self.swaps = dict.fromkeys(t.SWAP_OUTCOMES, 0)
        self.rejected = dict.fromkeys(t.REJECT_REASONS, 0)
        self.prompt_tokens = self.generation_tokens = self.decode_bytes = 0
        self.decode_seconds = 0.0
        self.last_bandwidth: float | None = None
        self.retired_kv = dict.fromkeys(_KV_COUNTERS, 0)  # the KV counters of versions already dropped
        self.ttft = t.Histogram(t.LATENCY_BUCKETS)
        self.tpot = t.Histogram(t.TPOT_BUCKETS)
        self.e2e = t.Histogram(t.E2E_BUCKETS)
        self.queue = t.Histogram(t.LATENCY_BUCKETS)
        self.prompt_len = t.Histogram(t.TOKEN_BUCKETS)
        self.output_len = t.Histogram(t.TOKEN_BUCKETS)
        self.step_tokens = t.Histogram(t.TOKEN_BUCKETS)
        self.step_seqs = t.Histogram(t.SEQ_BUCKETS)
        self.step_seconds = t.Histogram(t.STEP_SECONDS_BUCKETS)
        self.step_mask_seconds = t.Histogram(t.MASK_SECONDS_BUCKETS)  # steps that sampled a structured request


class EngineMetrics:
    """One engine's metrics (``engine.metrics``); see the module docstring for how it is fed.

    - :meth:`snapshot`: every figure as a :class:`~asyncinfer.metrics.MetricsSnapshot`;
    - :attr:`registry`: a ``prometheus_client.CollectorRegistry`` of its own (several engines in
      one process never collide) that renders the snapshot, plus the process collector;
    - :func:`asyncinfer.metrics.asgi_app` serves it: ``app.mount("/metrics", asgi_app(engine))``.

    With ``enable_metrics=False`` nothing is recorded (the snapshot's gauges are still read).
    """

    def __init__(self, engine: EngineView, config: EngineConfig, generators: list[tuple[str, ModelVersion]]) -> None:
        """``engine``: what a snapshot reads (held weakly); ``config``: its ``EngineConfig``
        (``enable_metrics``, ``device``, ``memory_bandwidth``, ``log_request_text_rate``);
        ``generators``: the generator versions it serves now, as ``(model name, version)``."""
        self._engine = weakref.ref(engine)
        self.enabled: bool = config.enable_metrics
        self.device: torch.device = config.device
        self._lock = threading.Lock()
        self._steps: deque[tuple[Any, ...]] = deque()
        self._figures: dict[str, _ModelFigures] = {}
        # Calls that named no model the engine holds: counted under no model's figures (a name from
        # user input must not make a per-model series), rendered with the fixed label model="".
        self._unknown_rejected = dict.fromkeys(t.REJECT_REASONS, 0)
        self._unknown_swaps = dict.fromkeys(t.SWAP_OUTCOMES, 0)
        self._versions: dict[int, tuple[str, ModelVersion]] = {}  # live generator versions by id
        # The KV cache of each version in ``_versions``, kept till its counters join ``retired_kv`` (under the
        # lock, as it leaves ``_versions``): the holder drops a version's core before it calls its retirement
        # back, and freeing that core lets a scrape run while the version has no core and no retired counts.
        self._version_kv: dict[int, KVCacheManager] = {}
        self._requests = RequestTracker(config.log_request_text_rate, self._tokenizer_of)
        self._registry: CollectorRegistry | None = None
        self._nvml: Nvml | None = None
        self.profiler: StepProfiler | None = None  # armed by engine.profile(); ticked by the step hook
        bandwidth = config.memory_bandwidth
        if bandwidth is None and generators and self.enabled:
            # On a thread that ends with it: a copy on the caller's thread would leave it an OpenMP
            # team that slows every engine step (see asyncinfer.threads).
            bandwidth = run_on_own_thread("asyncinfer-bandwidth", measure_memory_bandwidth, self.device)
        #: Bytes per second of the device's memory: the roofline's denominator.
        self.memory_bandwidth: float | None = bandwidth
        for name, version in generators:
            self.watch(name, version)

    # ------------------------------------------------------------ wiring
    def watch(self, name: str, version: ModelVersion) -> None:
        """Record the steps of ``version`` (a generator version of model ``name``), from its first."""
        core = version.core
        if core is None:
            return
        with self._lock:  # the engine thread drops retired versions from the table
            self._versions[version.version_id] = (name, version)
            self._version_kv[version.version_id] = core.kv
            self._model(name)
        kv = core.kv

        def retired(_version: ModelVersion) -> None:  # engine thread, once the version is dropped
            stats = kv.stats()
            with self._lock:
                base = self._model(name).retired_kv
                for key in _KV_COUNTERS:
                    base[key] += getattr(stats, key)
                self._versions.pop(version.version_id, None)
                self._version_kv.pop(version.version_id, None)

        version.on_retired.append(retired)
        if self.enabled or self.profiler is not None:
            core.on_step = self._step_hook(name, version)

    def _step_hook(self, name: str, version: ModelVersion) -> Callable[..., None]:
        """The core's ``on_step``: one tuple onto the deque, on the engine thread; nothing else."""
        append = self._steps.append
        config = version.config
        # What a decode step reads of the weights: all but the embedding table's unread rows.
        weights = decode_weight_bytes(version.model_config, config.dtype_bytes, config.quantization,
                                      config.quantization_skip, config.device)
        per_token = version.core.runner.spec.bytes_per_token if version.core is not None else 0
        record = self.enabled

        def on_step(batch: list[tuple[Request, int]], inputs: Any, result: Any, started: float) -> None:
            duration = time.perf_counter() - started
            if record:
                # A decode-only step reads the weights once, and the K/V of every context token attended over.
                bytes_read = 0 if result.prefill_tokens else weights + sum(inputs.context_lens) * per_token
                append((name, duration, len(batch), result.prefill_tokens + result.decode_tokens, bytes_read,
                        result.mask_seconds))
            profiler = self.profiler
            if profiler is not None and profiler.tick() and self.profiler is profiler:
                self.profiler = None

        return on_step

    def install_hooks(self) -> None:
        """Hook every live version's core (for a profile when metrics are off)."""
        for name, version in self.live_versions():
            if version.core is not None and version.core.on_step is None:
                version.core.on_step = self._step_hook(name, version)

    def live_versions(self) -> list[tuple[str, ModelVersion]]:
        """``(model name, version)`` of every generator version not dropped yet."""
        with self._lock:
            return list(self._versions.values())

    @property
    def num_tracked_requests(self) -> int:
        """Requests the metrics wait to see end (0 when idle: more is a leak in the bookkeeping)."""
        return len(self._requests.live)

    def track(self, request: Request, version_id: int) -> None:
        """A request was posted to the engine thread, bound to generator version ``version_id``."""
        if self.enabled:
            with self._lock:
                entry = self._versions.get(version_id)
                self._requests.track(request, entry[0] if entry else "")

    # ---------------------------------------------------------- loop side
    def outputs(self, outputs: list[CoreOutput]) -> None:
        """The stream table's observer: a batch of outputs, before it is dispatched (never raises)."""
        if not self.enabled:
            return
        try:
            self._count_outputs(outputs)
        except Exception:  # a metrics bug must never stop the outputs
            logger.exception("asyncinfer metrics: counting outputs failed")

    def failed(self) -> None:
        """The stream table's observer: the step loop died, every request in flight ends as an error."""
        if self.enabled:
            self.engine_failed()

    def _count_outputs(self, outputs: list[CoreOutput]) -> None:
        finished: list[FinishedRequest] = []
        with self._lock:
            self._drain_steps()
            for out in outputs:
                seen = self._requests.observe(out)
                if seen is None:
                    continue
                live, done = seen
                fig = self._model(live.model)
                fig.generation_tokens += len(out.token_ids)
                queued = self._requests.take_queue_time(live)
                if queued is not None:
                    fig.queue.observe(queued)
                if done is not None:
                    self._count_finished(fig, done)
                    finished.append(done)
        for done in finished:
            log_finished(done)

    def engine_failed(self) -> None:
        """The step loop died: every request in flight ended as an error."""
        with self._lock:
            ended = self._requests.fail_all(time.time())
            for done in ended:
                self._count_finished(self._model(done.model), done)
        for done in ended:
            log_finished(done)

    def _count_finished(self, fig: _ModelFigures, done: FinishedRequest) -> None:
        fig.requests[done.finish_reason] += 1
        fig.e2e.observe(done.latency)
        fig.prompt_len.observe(done.prompt_len)
        fig.output_len.observe(done.output_len)
        if done.ttft is not None:
            fig.prompt_tokens += done.prompt_len  # its prompt was computed
            fig.ttft.observe(done.ttft)
        if done.tpot is not None:
            fig.tpot.observe(done.tpot)

    def _drain_steps(self) -> None:
        """Move the engine thread's step tuples into the histograms (the lock is held)."""
        steps = self._steps
        while steps:
            name, duration, seqs, tokens, bytes_read, mask_seconds = steps.popleft()
            fig = self._model(name)
            fig.step_seconds.observe(duration)
            if mask_seconds:
                fig.step_mask_seconds.observe(mask_seconds)
            fig.step_seqs.observe(seqs)
            fig.step_tokens.observe(tokens)
            if bytes_read and duration > 0:
                fig.decode_bytes += bytes_read
                fig.decode_seconds += duration
                fig.last_bandwidth = bytes_read / duration

    def count_rejected(self, model: str | None, reason: str) -> None:
        if self.enabled:
            label = self._label(model)
            with self._lock:
                counts = self._model(label).rejected if label is not None else self._unknown_rejected
                counts[reason] += 1

    def count_aborted_waiting(self, model: str | None, request_id: str, n: int, prompt_len: int,
                              arrival: float) -> None:
        """A request aborted while it waited its turn (``intake.Turns``): never posted, it ends as an abort all the
        same, counted in ``requests`` and logged as any other (it was not: a wait cut short by ``abort()`` left no
        trace, where the same abort a moment later, once it was bound, was counted)."""
        if not self.enabled:
            return
        label = self._label(model)
        if label is None:
            return
        done = FinishedRequest(label, request_id, "abort", prompt_len, 0, None, None,
                               max(0.0, time.time() - arrival))
        with self._lock:
            self._count_finished(self._model(label), done)
        log_finished(done)

    def count_swap(self, model: str | None, outcome: str) -> None:
        """A ``swap_model`` of generator ``model`` (None: the default) ended: ok, refused, failed or cancelled."""
        if self.enabled:
            label = self._label(model)
            with self._lock:
                counts = self._model(label).swaps if label is not None else self._unknown_swaps
                counts[outcome] += 1

    def _label(self, model: str | None) -> str | None:
        """The model a call's ``model`` argument counts under: the default generator's name for None,
        None for a name the engine does not hold, or None with no generator (user input must not make
        new label values)."""
        names = [name for name, _ in self.live_versions()]
        if model is None:
            engine = self._engine()
            infos = engine.model_info() if engine is not None else []
            return next((i.name for i in infos if i.kind == "generate"), None)
        if not isinstance(model, str):  # a name of no model (a list, ...): counted under none, never raised
            return None
        model = str.__str__(model)  # the plain name: a label keeps no object whose methods are the caller's
        return model if model in names or model in self._figures else None

    def _model(self, name: str) -> _ModelFigures:
        fig = self._figures.get(name)
        if fig is None:
            fig = self._figures[name] = _ModelFigures()
        return fig

    def _tokenizer_of(self, name: str) -> Any:
        engine = self._engine()
        try:
            return engine.get_tokenizer(name) if engine is not None else None
        except AsyncInferError:
            return None

    # ------------------------------------------------------------ reading
    def snapshot(self) -> t.MetricsSnapshot:
        """Every figure now: counters and histograms so far, gauges read at this call."""
        engine = self._engine()
        with self._lock:
            self._drain_steps()
            models = {name: self._model_snapshot(name, fig, engine) for name, fig in self._figures.items()}
            unknown_rejected, unknown_swaps = dict(self._unknown_rejected), dict(self._unknown_swaps)
        for info in engine.model_info() if engine is not None else []:
            if info.kind == "embed":
                models[info.name] = self._embedder_snapshot(engine, info.name)
        cuda = cuda_memory(self.device)
        if cuda is not None and self._nvml is None:
            self._nvml = Nvml(self.device)
        return t.MetricsSnapshot(
            state=engine.state.value if engine is not None else "closed",
            device=str(self.device),
            requests_in_flight=engine.num_unfinished_requests if engine is not None else 0,
            models=models,
            unknown_model_rejected=unknown_rejected,
            unknown_model_swaps=unknown_swaps,
            memory_bandwidth=self.memory_bandwidth,
            process_rss_bytes=process_rss_bytes(),
            device_memory_allocated=None if cuda is None else cuda[0],
            device_memory_reserved=None if cuda is None else cuda[1],
            device_memory_total=None if cuda is None else cuda[2],
            device_utilization=None if self._nvml is None else self._nvml.utilization(),
        )

    def _model_snapshot(self, name: str, fig: _ModelFigures, engine: EngineView | None) -> t.ModelMetrics:
        versions = [(vid, v) for vid, (n, v) in self._versions.items() if n == name]
        kv_totals = dict(fig.retired_kv)
        for vid, _ in versions:  # a version being dropped (its core gone, not yet retired) still counts here
            stats = self._version_kv[vid].stats()
            for key in _KV_COUNTERS:
                kv_totals[key] += getattr(stats, key)
        live = [v for _, v in versions if v.core is not None]
        running = waiting = 0
        for version in live:
            core = version.core
            assert core is not None
            counts = core.queue_counts()  # a plugin's counts, or its queues' when they raise
            running += counts[0]
            waiting += counts[1]
        gauges: dict[str, Any] = {}
        current = self._current_kv(engine, name)
        if current is not None:
            gauges = {"kv_blocks": current.num_blocks, "kv_blocks_used": current.used_blocks,
                      "kv_blocks_cached_free": current.cached_free_blocks, "kv_usage": current.usage}
        peak, last = self.memory_bandwidth, fig.last_bandwidth
        return t.ModelMetrics(
            name=name, kind="generate", requests=dict(fig.requests), prompt_tokens=fig.prompt_tokens,
            generation_tokens=fig.generation_tokens, preemptions=kv_totals["preemptions"],
            prefix_cache_queried_tokens=kv_totals["prefix_queries"], prefix_cache_hit_tokens=kv_totals["prefix_hits"],
            kv_cow_copies=kv_totals["cow_copies"], kv_evictions=kv_totals["evictions"],
            kv_window_releases=kv_totals["window_releases"], swaps=dict(fig.swaps),
            rejected=dict(fig.rejected), decode_bytes_read=fig.decode_bytes, decode_seconds=fig.decode_seconds,
            running=running, waiting=waiting, versions_live=len(live), last_decode_bandwidth=last,
            last_decode_bandwidth_utilization=None if last is None or not peak else min(1.0, last / peak),
            ttft=fig.ttft.snapshot(), tpot=fig.tpot.snapshot(), e2e_latency=fig.e2e.snapshot(),
            queue_time=fig.queue.snapshot(), prompt_len=fig.prompt_len.snapshot(),
            output_len=fig.output_len.snapshot(), step_tokens=fig.step_tokens.snapshot(),
            step_sequences=fig.step_seqs.snapshot(), step_duration=fig.step_seconds.snapshot(),
            step_mask_duration=fig.step_mask_seconds.snapshot(), **gauges,
        )

    @staticmethod
    def _current_kv(engine: EngineView | None, name: str) -> Any:
        if engine is None:
            return None
        try:
            return engine.kv_stats(name)
        except AsyncInferError:  # removed, or between versions of a drain-mode swap
            return None

    @staticmethod
    def _embedder_snapshot(engine: EngineView, name: str) -> t.ModelMetrics:
        stats = engine.embedding_stats(name)
        return t.ModelMetrics(name=name, kind="embed", embedding_calls=stats.num_calls,
                              embedding_texts=stats.num_texts, embedding_batches=stats.num_batches,
                              embedding_tokens=stats.num_tokens, versions_live=1)

    @property
    def registry(self) -> CollectorRegistry:
        """This engine's own Prometheus registry (built on first use; needs ``prometheus-client``)."""
        if self._registry is None:
            from asyncinfer.metrics.exposition import build_registry

            self._registry = build_registry(self)
        return self._registry


@runtime_checkable
class EngineObservability(Protocol):
    """An engine's windows on itself, as ``AsyncEngine`` has them: :attr:`metrics`,
    ``memory_report()`` and ``await profile(steps, path)``.

    A protocol: ``isinstance(engine, EngineObservability)`` holds for an ``AsyncEngine``.
    The engine's methods delegate to :func:`asyncinfer.metrics.memory_report.memory_report`
    and :func:`asyncinfer.metrics.profile.profile_steps`.
    """

    metrics: EngineMetrics

    def memory_report(self) -> MemoryReport: ...

    async def profile(self, steps: int = 10, path: str | os.PathLike[str] = "asyncinfer-profile") -> ProfileResult: ...
