"""engine.metrics after a known workload on a tiny model: exact counts, in the snapshot and in /metrics."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncinfer import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    RequestFailedError,
    SamplingParams,
    SwapError,
)
from asyncinfer.metrics import EngineObservability, asgi_app
from asyncinfer.metrics.exposition import exposition, metric_names
from asyncinfer.metrics.types import SWAP_OUTCOMES
from asyncinfer.request import Request
from asyncinfer.schedulers import FIFOScheduler
from tests.helpers import SMOLLM2, loaded_bytes

OPTIONS = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "dtype": "float32", "device": "cpu",
           "memory_bandwidth": 1e10}


def parse(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def ids(n: int, start: int = 5) -> list[int]:
    return [start + i for i in range(n)]


async def test_a_known_workload_counts_exactly(tiny_models) -> None:
    path = tiny_models["llama"][0]
    engine = AsyncEngine.from_pretrained(path, **OPTIONS, max_num_seqs=1, max_waiting_requests=0)
    prompts = [ids(7), ids(12, 40), ids(3, 90)]
    async with engine:
        outs = [await engine.generate(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts]
        # stop: the third token of the first request as a stop token id
        stop = await engine.generate(prompts[0], SamplingParams(max_tokens=10, stop_token_ids=[outs[0].token_ids[2]]))
        assert stop.finish_reason == "stop"
        # abort: by id, mid-stream (the stream still ends with the abort's final delta); while it is
        # in flight, a second request is refused (one in flight is the limit). A slow reader's first
        # delta may already hold several tokens (the stream merges what it has not yet read).
        aborted_tokens, first = 0, True
        async for delta in engine.stream(ids(9, 120), SamplingParams(max_tokens=200, ignore_eos=True),
                                         request_id="to-abort"):
            aborted_tokens += len(delta.token_ids)
            if delta.finish_reason is None and first:
                first = False
                with pytest.raises(EngineOverloadedError):
                    await engine.generate(ids(4), SamplingParams(max_tokens=2))
                engine.abort("to-abort")
        with pytest.raises(InvalidParameterError):
            await engine.generate(ids(4), request_id="")
        # swaps: ok, refused (a bad mode), failed (no such model)
        await engine.swap_model(path)
        with pytest.raises(InvalidParameterError):
            await engine.swap_model(path, mode="sideways")
        with pytest.raises(SwapError):
            await engine.swap_model(path / "missing")
        after = await engine.generate(prompts[1], SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.num_unfinished_requests:
            await asyncio.sleep(0.01)
        snap = engine.metrics.snapshot()
        text = exposition(engine).decode()
        kv = engine.kv_stats()

    m = snap.models["default"]
    assert m.requests == {"stop": 1, "length": 4, "abort": 1, "error": 0}
    finished = [*outs, stop, after]
    assert m.generation_tokens == sum(o.num_output_tokens for o in finished) + aborted_tokens
    assert m.prompt_tokens == sum(len(o.prompt_token_ids) for o in finished) + 9
    assert m.swaps == {"ok": 1, "refused": 1, "failed": 1, "cancelled": 0}
    assert m.rejected == {"invalid": 1, "overloaded": 1}
    assert m.ttft.count == m.e2e_latency.count == m.prompt_len.count == 6
    assert m.tpot.count == 5 + (aborted_tokens >= 2)  # the abort lands at a step boundary: 1 or 2 tokens
    assert m.output_len.sum == m.generation_tokens
    assert m.running == m.waiting == 0 and m.versions_live == 1
    assert (m.kv_blocks, m.kv_blocks_used, m.kv_usage) == (kv.num_blocks, 0, 0.0)
    assert m.prefix_cache_queried_tokens >= kv.prefix_queries  # plus the swapped-out version's
    assert 0 < m.decode_bytes_read and 0 < m.decode_seconds
    assert m.last_decode_bandwidth_utilization == pytest.approx(m.last_decode_bandwidth / 1e10)

    got = parse(text)
    model = ("model", "default")
    for reason, count in m.requests.items():
        assert got[("asyncinfer_requests_total", (("finish_reason", reason), model))] == count
    assert got[("asyncinfer_generation_tokens_total", (model,))] == m.generation_tokens
    assert got[("asyncinfer_time_to_first_token_seconds_count", (model,))] == 6
    assert got[("asyncinfer_swaps_total", (model, ("outcome", "failed")))] == 1
    assert got[("asyncinfer_rejected_requests_total", (model, ("reason", "overloaded")))] == 1
    assert got[("asyncinfer_engine_state", (("state", "running"),))] == 1
    assert got[("asyncinfer_memory_bandwidth_bytes_per_second", (("device", "cpu"),))] == 1e10
    assert got[("process_resident_memory_bytes", ())] > 50 * 2**20
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {n.removesuffix("_total") for n in metric_names()} <= families


async def test_a_call_naming_an_unknown_model_makes_no_series_of_it(tiny_models) -> None:
    """A request or a swap naming a model the engine does not hold is counted once, under the fixed
    label model="" of the rejection and swap counters only: no other series names it, nor the name given."""
    path = tiny_models["llama"][0]
    async with AsyncEngine.from_pretrained(path, **OPTIONS) as engine:
        for name in ("nope", ""):
            with pytest.raises(InvalidParameterError):
                await engine.generate("x", SamplingParams(max_tokens=2), model=name)
        with pytest.raises((InvalidParameterError, SwapError)):
            await engine.swap_model(path, name="nope")
        snap = engine.metrics.snapshot()
        text = exposition(engine).decode()
    assert set(snap.models) == {"default"}
    assert snap.unknown_model_rejected == {"invalid": 2, "overloaded": 0}
    assert sum(snap.unknown_model_swaps.values()) == 1
    other = {(name, labels): v for (name, labels), v in parse(text).items()
             if dict(labels).get("model", "default") != "default"}
    assert other.keys() == {("asyncinfer_rejected_requests_total", (("model", ""), ("reason", r))) for r in
                            ("invalid", "overloaded")} | {("asyncinfer_swaps_total", (("model", ""), ("outcome", o)))
                                                          for o in SWAP_OUTCOMES}
    assert other[("asyncinfer_rejected_requests_total", (("model", ""), ("reason", "invalid")))] == 2


async def test_step_figures_equal_the_cores_counters(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS)
    async with engine:
        await asyncio.gather(*(engine.generate(ids(4 + 3 * i, 10 * i), SamplingParams(max_tokens=6 + i,
                                                                                     ignore_eos=True))
                               for i in range(6)))
        steps = engine.step_stats()
        m = engine.metrics.snapshot().models["default"]
    assert m.step_duration.count == m.step_tokens.count == m.step_sequences.count == steps.steps
    assert m.step_tokens.sum == steps.prefill_tokens + steps.decode_tokens
    assert m.step_sequences.sum == steps.scheduled_requests
    assert m.queue_time.count == 6
    assert m.generation_tokens == sum(6 + i for i in range(6))
    assert m.prompt_tokens == sum(4 + 3 * i for i in range(6))


def decode_read(model) -> int:
    """The weight bytes a decode step of ``model`` reads: all it holds but the embedding table, unless the
    logits are computed from that table itself (tied, and no format's head of its own; or an embedding kept in
    its file's blocks that reads the head's own)."""
    from asyncinfer.models.quant import BlockEmbedding

    if isinstance(model.embed_tokens, BlockEmbedding):
        embedding = model.embed_tokens
        assert embedding.shared == (embedding.table.blocks is model.output_proj.kernel_weights()[1])
        return loaded_bytes(model) - (0 if embedding.shared else embedding.table.blocks.numel())
    table = model.embed_tokens.weight
    head_is_table = model.output_proj is None and model.lm_head_weight is table
    return loaded_bytes(model) - (0 if head_is_table else table.numel() * table.element_size())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # an untied head, and a head that is the embedding table
async def test_roofline_bytes_of_one_request(tiny_models, kind) -> None:
    """One request, prompt 10, 6 tokens: 5 decode-only steps attending over 11..15 tokens, each reading every
    weight the model holds but the token embedding table, of which a step gathers one row: unless the table
    is the LM head too (tied, in the dtype), which every step reads whole."""
    engine = AsyncEngine.from_pretrained(tiny_models[kind][0], **OPTIONS)
    async with engine:
        await engine.generate(ids(10), SamplingParams(max_tokens=6, ignore_eos=True))
        m = engine.metrics.snapshot().models["default"]
        per_token = engine.core.runner.spec.bytes_per_token
        model = engine.core.runner.model
        weights = decode_read(model)
        tied = model.config.tie_word_embeddings
    assert tied == (kind == "qwen2")
    assert (weights == loaded_bytes(model)) == tied  # the tied float head is the table: read whole
    assert m.decode_bytes_read == 5 * weights + sum(range(11, 16)) * per_token
    assert m.decode_bandwidth == pytest.approx(m.decode_bytes_read / m.decode_seconds)


@pytest.mark.parametrize("fmt, table_read", [(None, True), ("float16", False), ("q4_1", False), ("q8_0", False),
                                             ("int8", True)])
def test_decode_weight_bytes_of_the_default_model(fmt, table_read) -> None:
    """SmolLM2-135M ties its head to the embedding table: read whole by each step where the head is the table
    (float32; int8 keeps lm_head in float32), not at all where a format holds a head of its own."""
    from asyncinfer.models.quant import decode_weight_bytes, default_skip, weight_bytes

    skip = default_skip(fmt)
    table = SMOLLM2.vocab_size * SMOLLM2.hidden_size * 4
    assert decode_weight_bytes(SMOLLM2, 4, fmt, skip) == weight_bytes(SMOLLM2, 4, fmt, skip) - (
        0 if table_read else table)


@pytest.mark.real_model
async def test_the_bandwidth_utilization_of_the_default_model_is_a_fraction(real_gguf) -> None:
    """The default model (Q4_1 projections; its embedding and the tied head one set of the file's Q8_0 blocks)
    against this machine's probe: each decode step reads every weight byte the model holds (92.1 MiB: no float32
    embedding table any more, the head's blocks read whole), and the ratio is in [0, 1]."""
    async with await AsyncEngine.load(real_gguf, max_model_len=256) as engine:
        ratios = []
        for start in (40, 60, 80):  # one request at a time: prompt 8, 12 tokens, 11 decode-only steps
            await engine.generate(ids(8, start), SamplingParams(max_tokens=12, ignore_eos=True))
            ratios.append(engine.metrics.snapshot().models["default"].last_decode_bandwidth_utilization)
        m = engine.metrics.snapshot().models["default"]
        per_token = engine.core.runner.spec.bytes_per_token
        model = engine.core.runner.model
        weights = decode_read(model)
    assert model.embed_tokens.shared and weights == loaded_bytes(model) == 96_576_768
    assert m.decode_bytes_read == 3 * (11 * weights + sum(range(9, 20)) * per_token)
    assert all(r is not None and 0.0 <= r <= 1.0 for r in ratios), ratios


async def test_a_step_faster_than_the_probe_reads_as_the_whole_bandwidth(tiny_models) -> None:
    """A decode step can outrun the start-up probe (weights served from a cache, a probe taken on a busy
    machine): the ratio stays 1 and the bytes per second say by how much."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **{**OPTIONS, "memory_bandwidth": 1.0})
    async with engine:
        await engine.generate(ids(10), SamplingParams(max_tokens=4, ignore_eos=True))
        m = engine.metrics.snapshot().models["default"]
        text = exposition(engine).decode()
    assert m.last_decode_bandwidth > 1.0 and m.last_decode_bandwidth_utilization == 1.0
    assert parse(text)[("asyncinfer_decode_bandwidth_utilization_ratio", (("model", "default"),))] == 1.0


@pytest.mark.parametrize("failures", [3, 1])  # 3: the fault fails its request; 1: it kills the engine
async def test_failed_requests_and_engine_death_count_as_errors(tiny_models, failures) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS, max_consecutive_step_failures=failures)
    async with engine:
        healthy = engine.core.runner.run

        def broken(inputs):
            raise RuntimeError("injected fault")

        engine.core.runner.run = broken
        error = RequestFailedError if failures > 1 else EngineDeadError
        with pytest.raises(error):
            await engine.generate(ids(5), SamplingParams(max_tokens=3))
        if failures > 1:
            engine.core.runner.run = healthy
            await engine.generate(ids(5), SamplingParams(max_tokens=3, ignore_eos=True))
        m = engine.metrics.snapshot().models["default"]
    assert m.requests["error"] == 1 and m.requests["length"] == (1 if failures > 1 else 0)
    assert engine.metrics.num_tracked_requests == 0


async def test_metrics_off_records_nothing_and_engines_do_not_share(tiny_models) -> None:
    one = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS, enable_metrics=False)
    two = AsyncEngine.from_pretrained(tiny_models["qwen2"][0], **OPTIONS)
    assert one.core.on_step is None and two.core.on_step is not None
    async with one, two:
        await one.generate(ids(5), SamplingParams(max_tokens=3, ignore_eos=True))
        await two.generate(ids(5), SamplingParams(max_tokens=4, ignore_eos=True))
        a, b = one.metrics.snapshot().models["default"], two.metrics.snapshot().models["default"]
    assert a.generation_tokens == 0 and a.step_duration.count == 0
    assert b.generation_tokens == 4 and sum(b.requests.values()) == 1
    assert one.metrics.registry is not two.metrics.registry


async def test_asgi_app_serves_the_exposition(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS)
    async with engine:
        await engine.generate(ids(5), SamplingParams(max_tokens=3, ignore_eos=True))
        transport = httpx.ASGITransport(app=asgi_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.get("/")
    assert response.status_code == 200
    got = parse(response.text)
    assert got[("asyncinfer_requests_total", (("finish_reason", "length"), ("model", "default")))] == 1
    assert got[("asyncinfer_engine_state", (("state", "running"),))] == 1


async def test_asgi_app_runs_on_its_own_lifespan_and_serves_get_and_head_only(tiny_models) -> None:
    """Run directly by a server (uvicorn), the app gets a lifespan scope: it completes startup and
    shutdown; GET serves the exposition, HEAD its headers, any other method is a 405."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS)
    app = asgi_app(engine)
    incoming: asyncio.Queue = asyncio.Queue()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    for event in ("lifespan.startup", "lifespan.shutdown"):
        incoming.put_nowait({"type": event})
    await asyncio.wait_for(app({"type": "lifespan", "asgi": {"version": "3.0"}}, incoming.get, send), 5)
    assert sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]
    async with engine:
        await engine.generate(ids(5), SamplingParams(max_tokens=3, ignore_eos=True))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            get, head = await client.get("/"), await client.head("/")
            refused = [await client.request(method, "/") for method in ("POST", "PUT", "DELETE")]
    assert get.status_code == 200 and get.headers["content-type"].startswith("text/plain")
    assert parse(get.text)[("asyncinfer_engine_state", (("state", "running"),))] == 1
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    for response in refused:
        assert (response.status_code, response.headers["allow"]) == (405, "GET, HEAD")
        assert response.text == "405 Method Not Allowed: GET or HEAD only\n"


async def test_one_log_line_per_request_and_text_only_when_sampled(tiny_models, caplog) -> None:
    caplog.set_level(logging.INFO, logger="asyncinfer.requests")
    for rate in (0.0, 1.0):
        engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS, log_request_text_rate=rate)
        async with engine:
            await engine.generate(ids(5), SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"r{rate}")
    lines = [r for r in caplog.records if r.name == "asyncinfer.requests"]
    assert len(lines) == 2
    plain, sampled = (r.asyncinfer_request for r in lines)
    assert plain["id"] == "r0.0" and plain["prompt_tokens"] == 5 and plain["output_tokens"] == 3
    assert plain["finish_reason"] == "length" and plain["ttft_s"] >= 0 and "prompt_text" not in plain
    assert "prompt_text" in sampled and "output_text" in sampled


def test_cuda_gauges_from_torch_and_nvml(tiny_models, monkeypatch) -> None:
    """The CUDA gauges' logic, on a CPU: torch's allocator figures and NVML's utilisation (a fake
    ``pynvml``) reach the snapshot and /metrics; NVML errors read as unknown, never fail a scrape."""
    import sys
    import types

    import torch

    from asyncinfer.metrics import device as device_module
    from asyncinfer.metrics import engine_metrics

    calls: list[int] = []
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: calls.append(-1)
    fake.nvmlDeviceGetHandleByIndex = lambda index: calls.append(index) or f"handle{index}"
    rates = {"handle1": 37}

    def utilization(handle: str) -> types.SimpleNamespace:
        if handle not in rates:
            raise RuntimeError("GPU is lost")
        return types.SimpleNamespace(gpu=rates[handle])

    fake.nvmlDeviceGetUtilizationRates = utilization
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nvml = device_module.Nvml(torch.device("cuda", 1))
    assert calls == [-1, 1] and nvml.utilization() == 0.37
    del rates["handle1"]
    assert nvml.utilization() is None  # a lost device: unknown
    assert device_module.Nvml(torch.device("cpu")).utilization() is None  # no CUDA, no NVML call
    assert device_module.cuda_memory(torch.device("cpu")) is None

    rates["handle1"] = 55
    monkeypatch.setattr(engine_metrics, "cuda_memory", lambda device: (3 << 20, 5 << 20, 80 << 30))
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS)
    engine.metrics._nvml = device_module.Nvml(torch.device("cuda", 1))
    snap = engine.metrics.snapshot()
    assert (snap.device_memory_allocated, snap.device_memory_reserved, snap.device_memory_total) == (
        3 << 20, 5 << 20, 80 << 30)
    assert snap.device_utilization == 0.55
    got = parse(exposition(engine).decode())
    assert got[("asyncinfer_device_memory_reserved_bytes", (("device", "cpu"),))] == 5 << 20
    assert got[("asyncinfer_device_utilization_ratio", (("device", "cpu"),))] == 0.55


class Recording(FIFOScheduler):
    """FIFO that keeps every request it was handed."""

    def __init__(self, config, kv) -> None:
        super().__init__(config, kv)
        self.seen: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.seen.append(request)
        super().add_request(request)


@pytest.mark.parametrize("enabled", [False, True])
async def test_the_engine_stamps_the_first_schedule_and_the_queue_time_is_read_from_it(tiny_models, enabled) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS, scheduler=Recording,
                                         enable_metrics=enabled)
    async with engine:
        before = time.time()
        await engine.generate(ids(5), SamplingParams(max_tokens=3, ignore_eos=True), request_id="one")
        after = time.time()
        (request,) = [r for r in engine.core.scheduler.seen if r.request_id == "one"]  # not the warm-up's
        m = engine.metrics.snapshot().models["default"]
    assert AsyncEngine.__mro__ == (AsyncEngine, object) and isinstance(engine, EngineObservability)
    assert request.scheduled_time is not None
    assert before <= request.arrival_time <= request.scheduled_time <= after
    if enabled:
        assert m.queue_time.count == 1 and m.queue_time.sum == request.scheduled_time - request.arrival_time
    else:
        assert m.queue_time.count == 0


async def test_the_waiting_gauge_may_read_above_max_waiting_requests(tiny_models) -> None:
    """docs/monitoring/README.md: admission bounds the requests in flight to max_num_seqs + max_waiting_requests, not
    the queue alone: the waiting gauge reads above max_waiting_requests when fewer than max_num_seqs requests can run
    (here the first request's two samples fill max_num_seqs=2 and the two others wait)."""
    path = tiny_models["llama"][0]
    engine = AsyncEngine.from_pretrained(path, **OPTIONS, max_num_seqs=2, max_waiting_requests=1)
    async with engine:
        params = SamplingParams(max_tokens=200, n=2, temperature=1.0, seed=1, ignore_eos=True)
        tasks = [asyncio.ensure_future(engine.generate(ids(4, start=5 + i), params)) for i in range(3)]
        while engine.num_unfinished_requests < 3:
            await asyncio.sleep(0.001)
        with pytest.raises(EngineOverloadedError):
            await engine.generate(ids(4), SamplingParams(max_tokens=2))
        assert engine.metrics.snapshot().requests_in_flight == 3
        seen = set()
        deadline = time.monotonic() + 30
        while not any(running >= 1 and waiting == 2 for running, waiting in seen) and time.monotonic() < deadline:
            model = engine.metrics.snapshot().models["default"]
            seen.add((model.running, model.waiting))
            await asyncio.sleep(0.001)
        assert any(running >= 1 and waiting == 2 for running, waiting in seen), seen
        await asyncio.gather(*tasks)


async def test_kv_counters_do_not_drop_while_a_swapped_out_version_is_freed(tiny_models) -> None:
    """The holder drops a version's core, then calls its retirement back; freeing that core (its weights, its
    KV tensors) let a scrape in between, which counted the version neither as live (no core) nor as retired:
    asyncinfer_prefix_cache_queried_tokens_total and the other KV counters fell back to the new version's,
    then rose again (a counter reset, to Prometheus)."""
    path = tiny_models["llama"][0]
    engine = AsyncEngine.from_pretrained(path, **OPTIONS)
    async with engine:
        await engine.generate(ids(20), SamplingParams(max_tokens=4, ignore_eos=True))
        await engine.generate(ids(20), SamplingParams(max_tokens=4, ignore_eos=True, n=2))
        before = engine.metrics.snapshot().models["default"]
        assert before.prefix_cache_queried_tokens > 0 and before.kv_cow_copies > 0
        [(_, old)] = engine.metrics.live_versions()
        seen: list[tuple[bool, int, int]] = []

        def freed(version) -> None:  # called back first: the core is gone, the version not yet retired
            snap = engine.metrics.snapshot().models["default"]
            seen.append((version.core is None, snap.prefix_cache_queried_tokens, snap.kv_cow_copies))

        old.on_retired.insert(0, freed)
        await engine.swap_model(path)
        while any(version is old for _, version in engine.metrics.live_versions()):  # retired after `freed`
            await asyncio.sleep(0.01)
        after = engine.metrics.snapshot().models["default"]
    assert seen == [(True, before.prefix_cache_queried_tokens, before.kv_cow_copies)]
    assert (after.prefix_cache_queried_tokens, after.kv_cow_copies) == (before.prefix_cache_queried_tokens,
                                                                       before.kv_cow_copies)
