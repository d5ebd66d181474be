"""Fault isolation (issue 10, item 3): a fault fails the requests of its step, not the engine.

Faults are injected in the forward pass, the sampler, a scheduler plugin's
``schedule`` and ``add_request``. The failed requests raise
``RequestFailedError`` with the fault as ``__cause__``, their blocks come back,
the prefix cache keeps nothing the failed step was to compute, and the engine
serves the next requests token for token as transformers does. Only faults on
``max_consecutive_step_failures`` steps in a row kill the engine, and then every
waiter gets ``EngineDeadError`` at once.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer import (
    AsyncEngine,
    EngineDeadError,
    EngineState,
    InvalidParameterError,
    RequestFailedError,
    SamplingParams,
)
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput

# block_size 4: a 21-token prompt fills 5 blocks that its first step registers in the prefix cache.
BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}
PROMPT = [(13 * j) % 300 + 3 for j in range(21)]
OTHER = [(29 * j) % 300 + 7 for j in range(9)]


def greedy(n_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens, ignore_eos=True, n=n)


class Injected(RuntimeError):
    """The fault the tests inject."""


def fail_on_calls(func, calls: set[int]):
    """``func``, raising :class:`Injected` on the given (1-based) calls."""
    count = 0

    def wrapper(*args, **kwargs):
        nonlocal count
        count += 1
        if count in calls:
            raise Injected(f"injected fault on call {count}")
        return func(*args, **kwargs)

    return wrapper


class FlakySampler:
    """Wraps the core's sampler (called as ``sampler(logits, states, greedy_ids=...)``) and fails chosen calls."""

    def __init__(self, sampler, calls: set[int]) -> None:
        self.call = fail_on_calls(sampler, calls)

    def __call__(self, logits, states, *, greedy_ids=None):
        return self.call(logits, states, greedy_ids=greedy_ids)


def assert_failed_by(err: pytest.ExceptionInfo, cause: type[BaseException] = Injected) -> None:
    assert type(err.value) is RequestFailedError
    assert isinstance(err.value.__cause__, cause)


async def test_a_forward_pass_fault_fails_its_step_and_poisons_no_cached_prefix(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, max_num_seqs=1)
    core = engine.core
    core.runner.run = fail_on_calls(core.runner.run, {1})
    async with engine:
        # max_num_seqs=1: the second request waits outside the failing step and is served.
        first = asyncio.create_task(engine.generate(PROMPT, greedy(6), request_id="first"))
        await asyncio.sleep(0)
        second = asyncio.create_task(engine.generate(OTHER, greedy(6)))
        with pytest.raises(RequestFailedError) as err:
            await first
        assert_failed_by(err)
        assert "'first'" in str(err.value) and "injected fault" in str(err.value)
        assert (await second).token_ids == hf_greedy(hf, OTHER, 6)
        # The failed step registered PROMPT's blocks but never wrote them: a hit would read garbage.
        again = await engine.generate(PROMPT, greedy(6), request_id="first")
        assert again.token_ids == hf_greedy(hf, PROMPT, 6)
        stats = engine.step_stats()
    assert stats.failed_steps == 1 and engine.state is EngineState.CLOSED
    assert engine.kv_stats().used_blocks == 0 and engine.kv_manager.request_ids() == []


async def test_a_sampler_fault_mid_decode_fails_its_requests_and_their_forked_samples(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE)
    core = engine.core
    # Call 1: the prompt step, where the n=3 request forks its samples; call 4: a decode of the n=1 request.
    core.sampler = FlakySampler(core.sampler, {1, 4})
    async with engine:
        with pytest.raises(RequestFailedError) as err:
            await engine.generate(PROMPT, greedy(5, n=3))
        assert_failed_by(err)
        assert engine.kv_manager.request_ids() == []  # the samples forked in the failed step are freed too
        with pytest.raises(RequestFailedError) as err:
            await engine.generate(OTHER, greedy(8))
        assert_failed_by(err)
        out = await engine.generate(PROMPT, greedy(5, n=3))
        assert [o.token_ids for o in out.outputs] == [hf_greedy(hf, PROMPT, 5)] * 3
        stream = [d async for d in engine.stream(OTHER, greedy(8))]
        assert [t for d in stream for t in d.token_ids] == hf_greedy(hf, OTHER, 8)
    assert engine.step_stats().failed_steps == 2
    assert engine.kv_stats().used_blocks == 0


class FlakyFIFO(FIFOScheduler):
    """FIFO with switches: ``hold`` schedules nothing; ``fail_on_copy`` raises in the ``schedule``
    that makes the first copy-on-write copy, after it allocated; ``add_request`` raises for "refused"."""

    hold = False
    fail_on_copy = False

    def schedule(self) -> SchedulerOutput:
        if self.hold:
            return SchedulerOutput()
        copies = self.kv.num_cow_copies
        out = super().schedule()
        if self.fail_on_copy and self.kv.num_cow_copies > copies:
            self.fail_on_copy = False
            raise Injected("schedule() raised after it allocated")
        return out

    def add_request(self, request) -> None:
        if request.request_id == "refused":
            raise Injected("add_request() raised")
        super().add_request(request)


async def test_a_scheduler_fault_fails_every_request_it_holds_and_the_engine_serves_on(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, scheduler=FlakyFIFO, max_num_seqs=2)
    sched = engine.core.scheduler
    sched.hold = sched.fail_on_copy = True
    async with engine:
        running = asyncio.create_task(engine.generate(PROMPT, greedy(40, n=2)))  # its samples share a partial block
        while len(sched.requests) < 1:
            await asyncio.sleep(0.002)
        waiting = asyncio.create_task(engine.generate(OTHER, greedy(4)))  # no seat left: waits
        while len(sched.requests) < 2:
            await asyncio.sleep(0.002)
        sched.hold = False  # step 1: the prompt, forked; step 2: the first decodes copy the shared block, and fail
        for task in (running, waiting):
            with pytest.raises(RequestFailedError, match="FlakyFIFO") as err:
                await task
            assert_failed_by(err)
        assert engine.kv_stats().used_blocks == 0 and sched.requests == {} and engine.kv_stats().cow_copies == 1
        # A fault in taking a request in fails that request only.
        refused = asyncio.create_task(engine.generate(OTHER, greedy(4), request_id="refused"))
        served = asyncio.create_task(engine.generate(PROMPT, greedy(7, n=2)))
        with pytest.raises(RequestFailedError, match="adding it") as err:
            await refused
        assert_failed_by(err)
        assert [o.token_ids for o in (await served).outputs] == [hf_greedy(hf, PROMPT, 7)] * 2
        assert (await engine.generate(OTHER, greedy(4), request_id="refused2")).token_ids == hf_greedy(hf, OTHER, 4)
    assert engine.kv_stats().used_blocks == 0 and engine.step_stats().failed_steps == 1


class AlwaysFails(FIFOScheduler):
    broken = False  # set once warm-up is done

    def schedule(self) -> SchedulerOutput:
        if self.broken:
            raise Injected("this scheduler always raises")
        return super().schedule()


async def test_faults_on_consecutive_steps_kill_the_engine_and_every_waiter_hears_at_once(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, scheduler=AlwaysFails,
                                         max_consecutive_step_failures=2)
    engine.core.scheduler.broken = True
    async with engine:
        with pytest.raises(RequestFailedError):  # failure 1 of 2: this request only
            await engine.generate(PROMPT, greedy(4))
        assert engine.state is EngineState.RUNNING
        waiters = [asyncio.create_task(engine.generate(OTHER, greedy(4))) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results)
        dead = results[0].__cause__
        assert isinstance(dead, EngineDeadError) and "2 consecutive steps" in str(dead)
        assert isinstance(dead.__cause__, Injected)
        assert engine.state is EngineState.DEAD
        assert [info.state for info in engine.model_info()] == ["dead"]  # it said "current"
        with pytest.raises(EngineDeadError):
            await engine.generate(OTHER, greedy(4))
    assert engine.state is EngineState.DEAD


async def test_a_success_between_two_faults_keeps_the_engine_alive(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, max_consecutive_step_failures=2)
    core = engine.core
    core.runner.run = fail_on_calls(core.runner.run, {1, 3})
    async with engine:
        for _ in range(2):
            with pytest.raises(RequestFailedError):
                await engine.generate(PROMPT, greedy(1))
            assert (await engine.generate(OTHER, greedy(1))).token_ids == hf_greedy(hf, OTHER, 1)
        assert engine.state is EngineState.RUNNING


def test_the_failure_options_are_checked(tiny_models) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidParameterError, match="max_consecutive_step_failures"):
            AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_consecutive_step_failures=bad)


class NamesAStranger(FIFOScheduler):
    """Broken once: its plan schedules a request it does not hold."""

    strange = False

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if self.strange:
            self.strange = False
            out.num_scheduled_tokens["nobody"] = 1
        return out


async def test_a_plan_naming_an_unknown_request_leaves_it_out(tiny_models, hf_greedy, caplog) -> None:
    """The engine holds each plan to the contract (EngineCore._check_plan): an entry for an id the scheduler
    does not hold is logged and left out, and the step runs for the requests it does hold (it used to fail
    them all, as a fault of schedule())."""
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, scheduler=NamesAStranger)
    engine.core.scheduler.strange = True
    async with engine:
        assert (await engine.generate(PROMPT, greedy(4))).token_ids == hf_greedy(hf, PROMPT, 4)
        assert "'nobody', a request it does not hold" in caplog.text
        assert (await engine.generate(PROMPT, greedy(4))).token_ids == hf_greedy(hf, PROMPT, 4)
        assert engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0


async def test_model_info_after_close_says_closed(tiny_models) -> None:
    """After ``aclose()`` no version takes requests: model_info said each was still ``"current"``."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE)
    async with engine:
        assert [(info.state, info.version_id) for info in engine.model_info()] == [("current", 0)]
    assert [(info.state, info.version_id) for info in engine.model_info()] == [("closed", 0)]
