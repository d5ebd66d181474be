"""A stranger's first hour writing a scheduler plugin for a multi-user service (stranger35).

examples/custom_scheduler.py, the per-tenant fair share docs/schedulers.md calls complete, took its ``weights`` option
unchecked, where the contract says to validate options and raise ``InvalidParameterError`` naming them. With
``--scheduler-option 'weights={"acme": 0}'`` the engine loaded and served until tenant "acme" sent a request; then
every ``schedule()`` raised ``ZeroDivisionError``: each such step failed every request the scheduler held (other
tenants' too) and the third ended the engine (``EngineDeadError`` for everyone). A negative, NaN or infinite weight
loaded as well, and put its tenant first for good or left the order meaningless, though the class declares itself
starvation-free.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections import defaultdict, deque
from itertools import zip_longest
from pathlib import Path
from typing import ClassVar

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.cache import KVCacheManager
from asyncinfer.errors import InvalidParameterError, RequestFailedError
from asyncinfer.request import Request
from asyncinfer.schedulers import FIFOScheduler, Scheduler, SchedulerConfig, SchedulerOutput
from asyncinfer.step import apply_step

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_scheduler.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_scheduler_stranger35", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("weights", [{"acme": 0}, {"acme": -1.0}, {"acme": float("nan")}, {"acme": float("inf")},
                                     {"acme": "2"}, {"acme": True}, {1: 2.0}, [1.0], "acme"])
def test_the_example_refuses_a_weight_it_cannot_use(example, weights) -> None:
    with pytest.raises(InvalidParameterError) as info:
        example.FairShareScheduler(SchedulerConfig(), KVCacheManager(8, 4), weights=weights)
    assert info.value.parameter == "weights"


@pytest.mark.parametrize("weights", [None, {}, {"acme": 2}, {"acme": 0.5, "": 3.0}])
def test_the_example_takes_positive_weights(example, weights) -> None:
    sched = example.FairShareScheduler(SchedulerConfig(), KVCacheManager(8, 4), weights=weights)
    assert sched.weights == dict(weights or {})


def test_a_zero_weight_no_longer_fails_every_tenant(example) -> None:
    """Driven without a model: the zero weight's ``schedule()`` raised ZeroDivisionError with "acme" queued."""
    try:
        sched = example.FairShareScheduler(SchedulerConfig(max_model_len=64), KVCacheManager(32, 4),
                                           weights={"acme": 0})
    except InvalidParameterError:
        return
    for rid in ("bob/0", "acme/0"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0))
    apply_step(sched, sched.schedule(), 0)  # raised ZeroDivisionError: every held request failed
    pytest.fail("the zero weight was taken")


class PerUserQueues(Scheduler):
    """A stranger's first fair share: a queue per user beside the base ``waiting``, one admission per user in
    turn, through ``admit_waiting``; the base ``abort_request`` is not overridden, so the own queues keep a
    request cancelled while it waits."""

    api_version = 1
    uses_priority = False

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        self.queues: dict[str, deque[Request]] = defaultdict(deque)

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.queues[request.request_id.partition("/")[0]].append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            order = [r for group in zip_longest(*self.queues.values()) for r in group if r is not None]
            self.admit_waiting(order, budget, out)
            for queue in self.queues.values():
                while queue and queue[0].request_id in out.num_scheduled_tokens:
                    queue.popleft()
        return out


def per_user_load() -> tuple[PerUserQueues, KVCacheManager]:
    kv = KVCacheManager(32, 4)
    sched = PerUserQueues(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), kv)
    for i in range(3):
        for user in ("alice", "bob"):
            sched.add_request(Request(f"{user}/{i}", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=0.0))
    return sched, kv


def test_a_request_cancelled_in_a_plugin_s_own_queue_fails_nobody_else() -> None:
    """bob/0 is cancelled while it waits: the base ``abort_request`` drops it from ``requests`` and ``waiting``,
    the plugin's own queue keeps it. ``admit`` allocated its blocks and then raised ``ValueError: Request(...) not
    in list`` from ``waiting.remove``: the step failed, and with it every request of every user the scheduler held
    (the engine: alice's ``RequestFailedError``), and the aborted request's blocks were never freed (``memory_report``:
    1/32 blocks held with no request in flight)."""
    sched, kv = per_user_load()
    sched.abort_request("bob/0")
    done: set[str] = set()
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        assert "bob/0" not in plan.num_scheduled_tokens
        for finished in apply_step(sched, plan, 0).finished:
            done.add(finished.request_id)
    assert done == {"alice/0", "alice/1", "alice/2", "bob/1", "bob/2"}
    assert kv.num_free_blocks == 32  # every block back, the aborted request's too


def test_admit_refuses_a_request_that_does_not_wait_before_taking_blocks() -> None:
    sched, kv = per_user_load()
    gone = sched.abort_request("bob/0")
    with pytest.raises(ValueError, match=r"'bob/0', which does not wait .*aborted or finished"):
        sched.admit(gone, 64, SchedulerOutput())
    assert kv.num_free_blocks == 32 and kv.block_table("bob/0") == []
    assert not sched.is_waiting(gone) and sched.is_waiting(sched.requests["alice/0"])


class AllocatesForAGhost(FIFOScheduler):
    """Takes blocks for a request it no longer holds (kept in a list of its own after its abort), then raises."""

    api_version = 1
    built: ClassVar[list[AllocatesForAGhost]] = []

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        self.gone: list[Request] = []
        self.raised = False
        AllocatesForAGhost.built.append(self)

    def abort_request(self, request_id: str) -> Request | None:
        request = super().abort_request(request_id)
        if request is not None:
            self.gone.append(request)
        return request

    def schedule(self) -> SchedulerOutput:
        if self.gone and not self.raised:
            self.raised = True
            stale = self.gone.pop()
            self.kv.allocate_slots(stale.request_id, stale.num_tokens, new_request=True)
            raise RuntimeError("a bug after the allocation")
        return super().schedule()


async def test_blocks_taken_for_a_request_the_scheduler_does_not_hold_are_freed_when_schedule_raises(
        tiny_llama: Path) -> None:
    """The engine failed the requests the scheduler held (documented) and freed their blocks; the blocks taken
    for the aborted id stayed allocated for good, nothing would end that id (a pool of 32 blocks lost 1 a time)."""
    engine = await AsyncEngine.load(tiny_llama, scheduler=AllocatesForAGhost, num_threads=1, max_num_seqs=1,
                                    max_model_len=512)
    async with engine:
        params = SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True)
        first = asyncio.create_task(engine.generate([5, 6, 7], params, request_id="alice/0"))
        waiting = asyncio.create_task(engine.generate([8, 9, 10], params, request_id="bob/0"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        results = await asyncio.gather(first, waiting, return_exceptions=True)
        assert isinstance(results[0], RequestFailedError)  # running when schedule() raised: documented
        assert isinstance(results[1], asyncio.CancelledError)
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id="carol/0")
        assert out.finish_reason == "length"  # the engine serves on
        kv = AllocatesForAGhost.built[-1].kv
        assert kv.request_ids() == []
        assert kv.num_free_blocks == kv.num_blocks


class PairsNotADict(FIFOScheduler):
    """Returns its plan's counts as a list of pairs (after the load's warm-up)."""

    api_version = 1
    steps = 0

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        PairsNotADict.steps += 1
        if PairsNotADict.steps > 3:
            out.num_scheduled_tokens = list(out.num_scheduled_tokens.items())
        return out


async def test_a_plan_whose_counts_are_no_dict_is_named(tiny_llama: Path) -> None:
    """It failed as the engine's own words: ``the scheduler (PairsNotADict) raised AttributeError: 'list' object has
    no attribute 'items'``, though the plugin raised nothing (docs/schedulers.md names a plan that is no
    ``SchedulerOutput`` as such; a ``SchedulerOutput`` holding no dict was not)."""
    engine = await AsyncEngine.load(tiny_llama, scheduler=PairsNotADict, num_threads=1, max_model_len=128)
    async with engine:
        with pytest.raises(RequestFailedError, match="num_scheduled_tokens is list, not a dict") as info:
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=4))
    assert isinstance(info.value.__cause__, TypeError)


@pytest.mark.parametrize(("name", "options", "parameter"), [
    ("aging-priority", {"preempt_margin": float("nan")}, "preempt_margin"),
    ("length-bucket", {"max_wait": float("inf")}, "max_wait"),
])
def test_a_priority_scheme_s_option_that_breaks_its_promise_is_refused(name, options, parameter) -> None:
    """``--scheduler-option preempt_margin=NaN`` (JSON reads it) was taken as "a number >= 0" and silently turned
    urgent preemption off; ``max_wait=Infinity`` left length-bucket without the bound it declares
    (``starvation_free``): a long request waited forever behind a stream of short ones."""
    from asyncinfer.schedulers import resolve_scheduler

    with pytest.raises(InvalidParameterError) as info:
        resolve_scheduler(name)(SchedulerConfig(), KVCacheManager(8, 4), **options)
    assert info.value.parameter == parameter


@pytest.mark.parametrize(("spec", "meant"), [
    ("examples/custom_scheduler.py:FairShareScheduler", "examples.custom_scheduler:FairShareScheduler"),
    ("./fair.py:Fair", "fair:Fair"),
    ("fair.py:Fair", "fair:Fair"),
])
def test_a_file_path_as_the_scheduler_is_named_as_one(spec, meant) -> None:
    """``asyncinfer serve --scheduler examples/custom_scheduler.py:FairShareScheduler`` (the path a shell completes)
    said ``No module named 'examples/custom_scheduler'``, and ``./fair.py:Fair`` "an absolute module and a class"."""
    from asyncinfer.schedulers import resolve_scheduler

    with pytest.raises(InvalidParameterError, match="not a file's path") as info:
        resolve_scheduler(spec)
    assert f"(here {meant}," in str(info.value)
