"""aging-priority: urgent first, a bounded wait for everyone, urgent arrivals may preempt."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.cache import KVCacheManager
from asyncinfer.lab import StepCostModel, TraceRequest, simulate
from asyncinfer.request import Request
from asyncinfer.schedulers import AgingPriorityScheduler, SchedulerConfig
from tests.helpers import schedule_and_apply

# Every step costs 0.1 s; with one request at a time, a 4-token prompt and 5 output
# tokens take 5 steps (the prefill yields the first token): 0.5 s of service each.
STEP = StepCostModel({"const": 0.1})
ONE_AT_A_TIME = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
SERVICE = 0.5


def stream_with_one_low(low_priority: int, until: float = 60.0) -> list[TraceRequest]:
    """Priority-0 requests every 0.4 s (more than the engine serves: the backlog grows without
    end), and one priority-``low_priority`` request arriving at t = 1 s."""
    trace = [TraceRequest(f"hi{i}", round(0.4 * i, 6), 4, 5, priority=0) for i in range(int(until / 0.4))]
    trace.append(TraceRequest("low", 1.0, 4, 5, priority=low_priority))
    return trace


def wait_of_low(trace: list[TraceRequest], **options) -> float:
    result = simulate(trace, "aging-priority", cost_model=STEP, config=ONE_AT_A_TIME, num_blocks=64, block_size=4,
                      options=options)
    return next(r.wait for r in result.records if r.id == "low")


@pytest.mark.parametrize("interval", [0.5, 1.0, 2.0])
def test_low_priority_wait_is_bounded_under_a_constant_urgent_stream(interval: float) -> None:
    # Bound: only requests whose arrival + priority * interval is earlier than the low
    # request's (1 + 5 * interval) go first; they started no earlier than t = 0 and each
    # takes SERVICE; one more may be in service when the low request becomes the next.
    ahead = sum(1 for i in range(150) if 0.4 * i < 1.0 + 5 * interval)
    bound = ahead * SERVICE + SERVICE - 1.0
    wait = wait_of_low(stream_with_one_low(5), aging_interval=interval)
    assert wait <= bound + 1e-9
    assert wait >= 5 * interval * 0.5  # ...and priority still counts: it did wait for urgent ones


def test_strict_priority_starves_the_low_request_until_the_stream_ends() -> None:
    trace = stream_with_one_low(5)
    strict = wait_of_low(trace, aging_interval=None)
    aged = wait_of_low(trace, aging_interval=1.0)
    assert strict > 60.0 and aged < 8.0  # strict: served only once the stream (60 s) is over


def make(rid: str, priority: int, t: float, n_prompt: int = 4) -> Request:
    return Request(rid, [1] * n_prompt, SamplingParams(max_tokens=50, ignore_eos=True), arrival_time=t,
                   priority=priority)


@pytest.mark.parametrize("preempt", [True, False])
def test_urgent_arrival_preempts_the_least_urgent_running_request(preempt: bool) -> None:
    sched = AgingPriorityScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), KVCacheManager(64, 4),
                                   preempt=preempt)
    now = [0.0]
    sched.clock = lambda: now[0]
    sched.add_request(make("bg-old", 5, 0.0))
    sched.add_request(make("bg-young", 6, 0.0))
    assert schedule_and_apply(sched) == {"bg-old": 4, "bg-young": 4}
    now[0] = 0.5
    sched.add_request(make("urgent", 0, 0.5))
    out = sched.schedule()
    if preempt:
        assert out.preempted == ["bg-young"]  # priority 6 (5.95 after 0.5 s of aging): the least urgent
        assert list(out.num_scheduled_tokens) == ["urgent", "bg-old"]  # budget goes to the most urgent first
    else:
        assert out.preempted == [] and "urgent" not in out.num_scheduled_tokens


def test_within_margin_no_preemption() -> None:
    sched = AgingPriorityScheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), KVCacheManager(64, 4),
                                   preempt_margin=2.0)
    sched.clock = lambda: 0.0
    sched.add_request(make("running", 3, 0.0))
    schedule_and_apply(sched)
    sched.add_request(make("slightly-urgent", 2, 0.0))
    assert sched.schedule().preempted == []


def test_the_step_budget_goes_to_the_most_urgent_first() -> None:
    """A low-priority long prompt being chunked does not hold the budget against an urgent request."""
    sched = AgingPriorityScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), KVCacheManager(64, 4))
    sched.clock = lambda: 0.0
    sched.add_request(make("long-low", 8, 0.0, n_prompt=100))
    assert schedule_and_apply(sched) == {"long-low": 16}
    sched.add_request(make("urgent", 0, 0.0, n_prompt=10))
    assert schedule_and_apply(sched) == {"urgent": 10, "long-low": 6}


async def test_priority_passes_through_generate_and_stream(tiny_llama: Path) -> None:
    """One sequence at a time: urgent requests arriving while a long low-priority one
    streams preempt it and finish first (FIFO would finish the long one first)."""
    engine = AsyncEngine.from_pretrained(tiny_llama, kv_cache_memory=1 << 20, max_model_len=128, device="cpu",
                                         dtype="float32", max_num_seqs=1, scheduler="aging-priority",
                                         scheduler_options={"aging_interval": 1000.0})
    async with engine:
        low = engine.stream([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), priority=5)
        first = (await low.__anext__()).token_ids  # the low request is running now (a slow reader's
        assert first  # first delta may already hold several tokens)
        urgent = [asyncio.create_task(engine.generate([9, 10 + i], SamplingParams(max_tokens=3, ignore_eos=True),
                                                      priority=0)) for i in range(3)]
        rest = [d async for d in low]
        low_done = time.time()
        outs = await asyncio.gather(*urgent)
    assert rest[-1].finish_reason == "length" and len(first) + sum(len(d.token_ids) for d in rest) == 100
    assert all(o.metrics.finish_time < low_done for o in outs)
    assert engine.step_stats().preemptions >= 1 and all(o.metrics.num_preemptions == 0 for o in outs)
