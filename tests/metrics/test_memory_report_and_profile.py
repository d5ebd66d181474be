"""engine.memory_report() tells held blocks from cached ones; engine.profile() writes a trace and a table."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from asyncinfer import AsyncEngine, EngineClosedError, InvalidParameterError, SamplingParams

OPTIONS = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "dtype": "float32", "device": "cpu",
           "memory_bandwidth": 1e10, "block_size": 4}


async def with_traffic(engine: AsyncEngine, job: asyncio.Future, timeout: float = 60) -> object:
    """Send requests until ``job`` (a profile) is done and return its result. A profile arms after its
    path check runs on a worker thread: a fixed amount of traffic sent at once may end before it arms."""
    async def traffic() -> None:
        while not job.done():
            await engine.generate(list(range(5, 15)), SamplingParams(max_tokens=4, ignore_eos=True))

    feeder = asyncio.ensure_future(traffic())
    try:
        return await asyncio.wait_for(asyncio.shield(job), timeout)
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)


async def until_profiling(engine: AsyncEngine, timeout: float = 60) -> None:
    """Send requests until the torch profiler runs (the armed profile has seen its first step)."""
    async def go() -> None:
        while not profiler_running():
            await engine.generate(list(range(5, 15)), SamplingParams(max_tokens=2, ignore_eos=True))

    await asyncio.wait_for(go(), timeout)


async def test_memory_report_tells_held_blocks_from_cached_ones(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS)
    async with engine:
        stream = engine.stream(list(range(5, 25)), SamplingParams(max_tokens=100, ignore_eos=True))
        await anext(stream)
        busy = engine.memory_report()
        await stream.aclose()
        while engine.num_unfinished_requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the abort's blocks return at the next step boundary
        idle = engine.memory_report()
    (model,) = busy.models
    assert (model.name, model.kind, model.requests_in_flight) == ("default", "generate", 1)
    assert model.used_blocks >= 5 and busy.held_blocks_without_requests == 0
    assert model.weight_bytes == engine.memory_plan.weight_bytes and model.kv_bytes == engine.memory_plan.kv_bytes
    (after,) = idle.models
    assert after.used_blocks == 0 and after.requests_in_flight == 0
    assert after.cached_free_blocks >= 5  # the prompt's full blocks stay cached: a cache, not a leak
    assert idle.process_rss_bytes > 0 and idle.allocated_bytes is None
    assert "KV pool" in idle.describe() and "RSS" in idle.describe()
    # one request in the singular (it said "1 requests in flight": stranger37's left item)
    assert busy.describe().splitlines()[0].startswith("device cpu, 1 request in flight, process RSS ")
    assert busy.describe().splitlines()[1].endswith(", 1 request in flight")
    assert idle.describe().splitlines()[0].startswith("device cpu, 0 requests in flight, ")


async def test_profile_wraps_the_next_steps(tiny_models, tmp_path) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS, enable_metrics=False)
    with pytest.raises(EngineClosedError):
        await engine.profile(steps=2, path=str(tmp_path))
    async with engine:
        for bad in (0, 10_001, 10**12, True, 2.0):  # an unbounded profile would hold every step's ops forever
            with pytest.raises(InvalidParameterError) as err:
                await asyncio.wait_for(engine.profile(steps=bad, path=str(tmp_path)), 5)  # refused before a step
            assert err.value.parameter == "steps" and "10000" in str(err.value)
        job = asyncio.ensure_future(engine.profile(steps=3, path=str(tmp_path / "prof")))
        result = await with_traffic(engine, job)
    assert result.steps == 3
    trace = json.loads(result.trace_path.read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)
    assert "aten::" in result.table and result.table_path.read_text().startswith("3 engine steps")


def profiler_running() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


async def test_a_cancelled_profile_frees_its_slot_at_once(tiny_models, tmp_path) -> None:
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS) as engine:
        with pytest.raises(asyncio.TimeoutError):  # an idle engine: no step comes
            await asyncio.wait_for(engine.profile(steps=2, path=tmp_path / "a"), 0.2)
        # Started, then abandoned mid-way: the torch profiler stops with it.
        job = asyncio.ensure_future(engine.profile(steps=10_000, path=tmp_path / "b"))
        await until_profiling(engine)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert not profiler_running()
        job = asyncio.ensure_future(engine.profile(steps=2, path=tmp_path / "c"))  # the slot is free
        assert (await with_traffic(engine, job)).steps == 2
        # Closing the engine mid-profile ends it too.
        job = asyncio.ensure_future(engine.profile(steps=10_000, path=tmp_path / "d"))
        await until_profiling(engine)
    with pytest.raises(EngineClosedError):
        await job
    assert not profiler_running()


async def test_a_bad_path_is_refused_before_any_step(tiny_models, tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTIONS) as engine:
        for bad in ("", tmp_path / "file", tmp_path / "file" / "below", 42):
            with pytest.raises(InvalidParameterError) as err:
                await asyncio.wait_for(engine.profile(steps=2, path=bad), 5)  # no traffic: refused at once
            assert err.value.parameter == "path"
        job = asyncio.ensure_future(engine.profile(steps=1, path=tmp_path / "ok"))  # nothing was left armed
        assert (await with_traffic(engine, job)).trace_path == tmp_path / "ok" / "trace.json"


async def test_a_profile_of_an_engine_without_a_generator_is_refused(minilm_dir, tiny_models, tmp_path) -> None:
    """Only a generator's steps tick a profile: on an engine of embedding models alone ``profile()`` waited
    for ever, embeddings served or not. It is refused now; once a generator is added, it profiles."""
    async with AsyncEngine.from_pretrained(minilm_dir, max_wait_ms=0) as engine:
        with pytest.raises(InvalidParameterError, match="holds no generator") as caught:
            await asyncio.wait_for(engine.profile(steps=1, path=tmp_path / "p"), 30)
        assert caught.value.parameter == "steps" and caught.value.value == 1
        assert not (tmp_path / "p").exists()  # refused before the directory was made
        await engine.add_model("gen", tiny_models["llama"][0], **OPTIONS)
        job = asyncio.ensure_future(engine.profile(steps=1, path=tmp_path / "p"))
        result = await with_traffic(engine, job)
        assert (tmp_path / "p" / "trace.json").exists() and result.table
