"""The base-class helpers plugins build on: admission order, whole-prompt admission, skipping."""

from __future__ import annotations

from asyncinfer.cache import KVCacheManager
from asyncinfer.request import Request, RequestStatus
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers import PDSplitScheduler, SchedulerConfig, SchedulerOutput


def make(rid: str, n_prompt: int) -> Request:
    return Request(rid, [5] * n_prompt, SamplingParams(max_tokens=50), arrival_time=0.0)


def sched(num_blocks: int, budget: int, max_seqs: int = 8) -> PDSplitScheduler:
    # Any concrete policy will do; the helpers live on the base class.
    return PDSplitScheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                            KVCacheManager(num_blocks, 4, watermark=0.0))


def test_admit_needs_room_for_the_whole_prompt_not_only_the_first_chunk() -> None:
    s = sched(num_blocks=10, budget=8)
    long = make("long", 48)  # 12 blocks: more than the cache has free
    s.add_request(long)
    out = SchedulerOutput()
    assert s.admit(long, 8, out) == 0  # its first chunk (2 blocks) would fit, the prompt would not
    assert long.status is RequestStatus.WAITING and s.kv.num_free_blocks == 10 and out.is_empty
    short = make("short", 40)  # 10 blocks: fits exactly
    s.add_request(short)
    assert s.admit(short, 8, out) == 8
    assert short.status is RequestStatus.RUNNING and out.num_scheduled_tokens == {"short": 8}


def test_admit_waiting_stops_at_the_first_that_does_not_fit() -> None:
    s = sched(num_blocks=12, budget=100)
    for rid, n in (("a", 8), ("big", 60), ("c", 4)):
        s.add_request(make(rid, n))
    out = SchedulerOutput()
    left = s.admit_waiting(list(s.waiting), 100, out)
    assert list(out.num_scheduled_tokens) == ["a"] and left == 92  # "c" would fit, but not past "big"


def test_admit_waiting_respects_max_num_seqs_and_budget() -> None:
    s = sched(num_blocks=100, budget=10, max_seqs=2)
    for i in range(4):
        s.add_request(make(f"r{i}", 4))
    out = SchedulerOutput()
    assert s.admit_waiting(list(s.waiting), 10, out) == 2
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]


def test_schedule_running_skips_and_preempts_from_the_end() -> None:
    s = sched(num_blocks=6, budget=100)
    for rid in ("a", "b", "c"):
        s.add_request(make(rid, 8))  # 2 blocks each: the cache is full
    s.admit_waiting(list(s.waiting), 100, SchedulerOutput())
    for r in s.running:
        r.num_computed_tokens = 8
        r.output_token_ids.append(3)  # each now needs a 3rd block
    out = SchedulerOutput()
    s.schedule_running(out, 100, skip={"b"})
    assert out.preempted == ["c"] and out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in s.running] == ["a", "b"]
