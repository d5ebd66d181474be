"""aging-priority and length-bucket keep their waiting queues in order (schedulers/ordered.py): a step reads them from
the head, never ranking every waiting request.

The order is the one each policy always had (aging-priority: every running and waiting request ranked by ``rank`` at
the step's time; length-bucket: preempted and aged requests in arrival order, then each bucket; ties in queue order):
a reference scheduler that sorts them all at every step, as the policy did, is driven beside it through random
arrivals, aborts, preemptions and clock ticks, and every step's plan and both queues must agree.
"""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncinfer.cache import KVCacheManager
from asyncinfer.request import Request, RequestStatus
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers import AgingPriorityScheduler, LengthBucketScheduler, SchedulerConfig, SchedulerOutput
from asyncinfer.step import apply_step


class FullSort(AgingPriorityScheduler):
    """aging-priority's order computed as it was before the ordered queue: every request ranked at every step."""

    def _in_order(self) -> Iterator[Request]:
        now = self.clock()
        return iter(sorted([*self.running, *self.waiting], key=lambda r: self.rank(r, now)))


class SortedBuckets(LengthBucketScheduler):
    """length-bucket's admission order computed as it was before the ordered lanes: every waiting request sorted."""

    def _waiting_order(self, now: float) -> Iterator[Request]:
        def order(request: Request) -> tuple[int, int, float]:
            if request.status is RequestStatus.PREEMPTED or now - request.arrival_time >= self.max_wait:
                return (0, 0, request.arrival_time)
            return (1, self.bucket_of(request), request.arrival_time)

        return iter(sorted(self.waiting, key=order))


# Times and intervals in quarters of a second: every key and rank is an exact float, so the two orders can only
# differ where the code does.
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(-1, 1), st.integers(1, 30), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("tick"), st.sampled_from([0, 0, 1, 2, 8])),  # many requests of equal keys: the ties count
    st.tuples(st.just("step"),),
), min_size=1, max_size=120)


def _pair(policy: str, interval: float | None, preempt: bool, blocks: int) -> list:
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64)
    if policy == "aging-priority":
        return [cls(config, KVCacheManager(blocks, 4), aging_interval=interval, preempt=preempt)
                for cls in (AgingPriorityScheduler, FullSort)]
    # length-bucket: interval stands for max_wait (None: the default 30 s, never reached), buckets of 8 and 16
    wait = 30.0 if interval is None else interval
    return [cls(config, KVCacheManager(blocks, 4), bucket_edges=(8, 16), max_wait=wait)
            for cls in (LengthBucketScheduler, SortedBuckets)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a preempted request comes back ahead of a waiting one of the same key (as at the old queue's head)
@example(ops=[("add", 0, 3, 3), ("add", 0, 11, 3), ("step",), ("add", 0, 1, 2), ("step",), ("add", 0, 1, 1), ("step",),
              ("step",)], interval=0.25, preempt=False, blocks=6, policy="aging-priority")
# requests aged past max_wait leave their buckets in arrival order, across buckets
@example(ops=[("add", 0, 1, 8), ("add", 0, 1, 1), ("tick", 1), ("step",)], interval=0.25, preempt=False, blocks=6,
         policy="length-bucket")
@given(ops=OPS, interval=st.sampled_from([0.25, 1.0, 4.0, None]), preempt=st.booleans(),
       blocks=st.integers(6, 24), policy=st.sampled_from(["aging-priority", "length-bucket"]))
def test_the_ordered_queue_plans_every_step_as_ranking_every_request_did(ops, interval, preempt, blocks,
                                                                           policy) -> None:
    _drive(_pair(policy, interval, preempt, blocks), ops)


def _drive(scheds: list, ops: list) -> None:
    """Apply ``ops`` to every scheduler of ``scheds`` alike; every step's plan and both queues must agree."""
    now = [0.0]
    for sched in scheds:
        sched.clock = lambda: now[0]
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, priority, prompt, max_tokens = op
            rid = f"r{len(added)}"
            added.append(rid)
            for sched in scheds:
                sched.add_request(Request(rid, [5] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                          arrival_time=now[0], priority=priority))
        elif op[0] == "abort" and added:
            rid = added[op[1] % len(added)]
            assert [s.abort_request(rid) is None for s in scheds] in ([True, True], [False, False])
        elif op[0] == "tick":
            now[0] += op[1] * 0.25
        elif op[0] == "step":
            plans = [s.schedule() for s in scheds]
            assert list(plans[0].num_scheduled_tokens.items()) == list(plans[1].num_scheduled_tokens.items())
            assert plans[0].preempted == plans[1].preempted
            for sched, plan in zip(scheds, plans):
                sched.kv.commit_step()
                apply_step(sched, plan, 7)
        mine, theirs = scheds
        assert [r.request_id for r in mine.waiting] == [r.request_id for r in theirs.waiting]
        assert [r.request_id for r in mine.running] == [r.request_id for r in theirs.running]


def _docs_ordered_plugin(monkeypatch) -> type:
    """docs/schedulers.md's OrderedScheduler example, run as written (its registration left out)."""
    import re
    from pathlib import Path

    import asyncinfer.schedulers

    text = (Path(__file__).resolve().parents[2] / "docs" / "schedulers.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "(OrderedScheduler)" in b)
    monkeypatch.setattr(asyncinfer.schedulers, "register_scheduler", lambda name: (lambda cls: cls))
    namespace: dict = {}
    exec(block, namespace)  # noqa: S102 -- the docs' own example, from this repository
    return namespace["ShortestFirstOrdered"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(ops=OPS, blocks=st.integers(6, 24))
def test_the_docs_ordered_plugin_admits_as_sorting_the_queue_does(monkeypatch, ops, blocks) -> None:
    """The docs' shortest-first policy on OrderedScheduler plans every step as the same policy sorting
    ``self.waiting`` at every step (the docs' first example) does."""
    plugin = _docs_ordered_plugin(monkeypatch)

    class Sorting(plugin):  # type: ignore[misc, valid-type]
        def schedule(self):  # type: ignore[no-untyped-def]
            out = SchedulerOutput()
            budget = self.schedule_running(out, self.config.max_num_batched_tokens)
            if not out.preempted:
                self.admit_waiting(sorted(self.waiting, key=self.key_of), budget, out)
            return out

    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64)
    _drive([cls(config, KVCacheManager(blocks, 4)) for cls in (plugin, Sorting)], ops)


class CountingRanks(AgingPriorityScheduler):
    """Counts the requests the policy ranks or keys."""

    calls = 0

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        CountingRanks.calls += 1
        return super().rank(request, now)

    def order_key(self, request: Request) -> tuple[float, float]:
        CountingRanks.calls += 1
        return super().order_key(request)


def test_a_step_with_twenty_thousand_waiting_ranks_only_what_it_meets() -> None:
    """One caller's 20,000 queued requests cost every step a rank of each (1-1.5 us a request, on the engine
    thread: a neighbour's 0.8 ms token took 20-27 ms); now a step ranks the running requests and the waiting ones
    it reaches."""
    sched = CountingRanks(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                          KVCacheManager(64, 4))
    sched.clock = lambda: 5.0
    for i in range(20_000):
        sched.add_request(Request(f"q{i}", [5] * 8, SamplingParams(max_tokens=50, ignore_eos=True),
                                  arrival_time=i * 1e-4, priority=i % 5))
    plan = sched.schedule()  # two admitted (max_num_seqs), the rest wait
    apply_step(sched, plan, 7)
    assert len(sched.running) == 2 and len(sched.waiting) == 19_998
    for _ in range(10):
        CountingRanks.calls = 0
        plan = sched.schedule()
        sched.kv.commit_step()
        apply_step(sched, plan, 7)
        assert sorted(plan.num_scheduled_tokens.values()) == [1, 1]
        assert CountingRanks.calls <= 8, CountingRanks.calls


class CountingBuckets(LengthBucketScheduler):
    """Counts the requests the policy measures or keys."""

    calls = 0

    def bucket_of(self, request: Request) -> int:
        CountingBuckets.calls += 1
        return super().bucket_of(request)

    def key_of(self, request: Request) -> float:
        CountingBuckets.calls += 1
        return super().key_of(request)


def test_length_bucket_with_twenty_thousand_waiting_sorts_none_of_them() -> None:
    """length-bucket sorted every waiting request at every step (a neighbour's 0.8 ms token took 20-24 ms with 20,000
    waiting); now a step reads the buckets' heads."""
    sched = CountingBuckets(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                            KVCacheManager(64, 4), max_wait=1.0)
    now = [0.0]
    sched.clock = lambda: now[0]
    for i in range(20_000):
        sched.add_request(Request(f"q{i}", [5] * (1 + i % 9), SamplingParams(max_tokens=2 + i % 40, ignore_eos=True),
                                  arrival_time=i * 1e-4))
    plan = sched.schedule()
    apply_step(sched, plan, 7)
    assert len(sched.running) == 2 and len(sched.waiting) == 19_998
    for step in range(10):
        now[0] = 0.5 * step  # past max_wait too: the aged requests are each bucket's head
        CountingBuckets.calls = 0
        plan = sched.schedule()
        sched.kv.commit_step()
        apply_step(sched, plan, 7)
        assert CountingBuckets.calls <= 4, CountingBuckets.calls


def test_the_lanes_keep_no_finished_request_once_the_queue_is_empty() -> None:
    """Entries of admitted requests are dropped lazily; once nothing waits, a step's read leaves no entry (and so no
    reference to a finished request's tokens) behind."""
    import gc
    import weakref

    sched = AgingPriorityScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                                   KVCacheManager(64, 4))
    sched.clock = lambda: 0.0
    refs = []
    for i in range(40):
        request = Request(f"r{i}", [5] * 4, SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=i * 0.01)
        refs.append(weakref.ref(request))
        sched.add_request(request)
        del request
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sched.kv.commit_step()
        apply_step(sched, plan, 7)
    sched.schedule()  # an idle step reads the (empty) queue
    gc.collect()
    assert [r for r in refs if r() is not None] == []
