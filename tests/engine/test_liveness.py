"""Liveness (issue 10, item 5): a step loop that can schedule nothing backs off, then fails the stuck requests.

A deliberately broken plugin scheduler that schedules nothing stands for any
policy with a liveness bug. The engine thread must not burn a core while its
requests wait, and after ``stall_timeout`` seconds the requests fail with
``RequestStalledError`` naming the cause, so neither the callers nor ``aclose()``
wait forever.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncinfer import (
    AsyncEngine,
    InvalidParameterError,
    ModelLoadError,
    RequestFailedError,
    RequestStalledError,
    SamplingParams,
    SwapError,
)
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu"}
PROMPT = [5, 17, 99, 3, 250, 42, 8]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


class Sulking(FIFOScheduler):
    """Schedules nothing while ``sulk`` is set (a liveness bug that a test can switch on and off)."""

    sulk = False

    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput() if self.sulk else super().schedule()


async def test_a_scheduler_that_schedules_nothing_costs_no_cpu_and_its_requests_fail_in_time(
    tiny_models, hf_greedy
) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, scheduler=Sulking, stall_timeout=1.0)
    engine.core.scheduler.sulk = True
    async with engine:
        wall, cpu = time.monotonic(), time.process_time()
        results = await asyncio.wait_for(
            asyncio.gather(*(engine.generate(PROMPT, greedy(4)) for _ in range(2)), return_exceptions=True), 20)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        assert all(type(r) is RequestStalledError for r in results), results
        assert isinstance(results[0], RequestFailedError)
        message = str(results[0])
        assert "Sulking" in message and "stall_timeout=1.0" in message and "2 waiting" in message
        assert 1.0 <= wall < 5.0
        # A spinning loop burns ~1 CPU-second per second here; backing off costs next to nothing.
        assert cpu < 0.25 * wall, f"{cpu:.2f} s of CPU over {wall:.2f} s"
        stats = engine.step_stats()
        assert 0 < stats.idle_steps < 200 and stats.steps == 0
        engine.core.scheduler.sulk = False  # the engine itself is fine: the next request is served
        assert (await engine.generate(PROMPT, greedy(4))).token_ids == hf_greedy(hf, PROMPT, 4)
    assert engine.kv_stats().used_blocks == 0


async def test_aclose_returns_when_requests_are_stuck(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, scheduler=Sulking, stall_timeout=0.3)
    engine.core.scheduler.sulk = True
    await engine.start()
    stuck = asyncio.create_task(engine.generate(PROMPT, greedy(4)))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(engine.aclose(), 10)  # drains: the stuck request fails, then the thread ends
    with pytest.raises(RequestStalledError):
        await stuck


async def test_a_slow_start_is_not_a_stall(tiny_models, hf_greedy) -> None:
    """Idle steps that end before stall_timeout fail nothing: the count restarts once something runs."""
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, scheduler=Sulking, stall_timeout=0.5)
    sched = engine.core.scheduler
    async with engine:
        for _ in range(3):
            sched.sulk = True
            task = asyncio.create_task(engine.generate(PROMPT, greedy(3)))
            await asyncio.sleep(0.3)
            sched.sulk = False
            assert (await task).token_ids == hf_greedy(hf, PROMPT, 3)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_stall_timeout_is_checked(tiny_models, bad) -> None:
    with pytest.raises(InvalidParameterError, match="stall_timeout"):
        AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, stall_timeout=bad)


class Lazy(FIFOScheduler):
    """Never schedules anything: a load's warm-up must fail on it, not spin forever."""

    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput()


async def test_a_scheduler_that_schedules_nothing_fails_the_load_warm_up_in_time(tiny_models) -> None:
    path = tiny_models["llama"][0]
    wall = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"failed: the scheduler Lazy scheduled nothing "
                                             r"during warm-up .*stall_timeout=0\.3") as err:
        await asyncio.wait_for(AsyncEngine.load(path, **BASE, scheduler=Lazy, stall_timeout=0.3), 20)
    assert 0.3 <= time.monotonic() - wall < 10.0
    assert isinstance(err.value.__cause__, RuntimeError)


async def test_a_swap_or_added_model_whose_scheduler_schedules_nothing_fails_and_the_engine_keeps_serving(
    tiny_models, hf_greedy
) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE)
    async with engine:
        with pytest.raises(SwapError, match="the scheduler Lazy scheduled nothing during warm-up"):
            await asyncio.wait_for(engine.swap_model(tiny_models["qwen2"][0], scheduler=Lazy, stall_timeout=0.3), 20)
        with pytest.raises(ModelLoadError, match="the scheduler Lazy scheduled nothing during warm-up"):
            await asyncio.wait_for(
                engine.add_model("second", tiny_models["qwen2"][0], scheduler=Lazy, stall_timeout=0.3), 20)
        assert (await engine.generate(PROMPT, greedy(4))).token_ids == hf_greedy(hf, PROMPT, 4)
