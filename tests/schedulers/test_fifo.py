"""FIFO scheduler: budget, admission order, chunked prefill and preemption of the youngest."""

from __future__ import annotations

from asyncinfer.cache import KVCacheManager
from asyncinfer.request import Request, RequestStatus
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers import FIFOScheduler, SchedulerConfig
from tests.helpers import schedule_and_apply


def make(rid: str, n_prompt: int, t: float = 0.0) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=100), arrival_time=t)


def test_token_budget_and_chunked_prefill() -> None:
    kv = KVCacheManager(64, 4, watermark=0.0)
    sched = FIFOScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), kv)
    sched.add_request(make("a", 7))
    sched.add_request(make("b", 9))
    assert schedule_and_apply(sched) == {"a": 7, "b": 3}  # b gets a 3-token chunk
    assert schedule_and_apply(sched) == {"a": 1, "b": 6}
    assert schedule_and_apply(sched) == {"a": 1, "b": 1}
    assert len(kv.block_table("b")) == 3  # 10 tokens -> 3 blocks of 4


def test_max_num_seqs_and_arrival_order() -> None:
    kv = KVCacheManager(64, 4, watermark=0.0)
    sched = FIFOScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), kv)
    for i in range(3):
        sched.add_request(make(f"r{i}", 2, t=i))
    assert list(schedule_and_apply(sched)) == ["r0", "r1"]
    req = sched.requests["r0"]
    req.status = RequestStatus.FINISHED_STOPPED
    sched.finish_requests([req])
    assert list(schedule_and_apply(sched)) == ["r1", "r2"]


def test_preempts_youngest_when_blocks_run_out() -> None:
    kv = KVCacheManager(4, 2, watermark=0.0)
    sched = FIFOScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), kv)
    sched.add_request(make("old", 4))
    sched.add_request(make("young", 4))
    assert schedule_and_apply(sched) == {"old": 4, "young": 4}  # all 4 blocks used
    out = sched.schedule()  # each needs a 3rd block: the youngest goes
    assert out.preempted == ["young"]
    assert out.num_scheduled_tokens == {"old": 1}
    young = sched.requests["young"]
    assert young.status is RequestStatus.PREEMPTED and young.num_computed_tokens == 0
    assert sched.waiting[0] is young and kv.block_table("young") == []


def test_abort_frees_blocks_everywhere() -> None:
    kv = KVCacheManager(16, 4, watermark=0.0)
    sched = FIFOScheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100), kv)
    sched.add_request(make("run", 5))
    sched.add_request(make("wait", 5))
    schedule_and_apply(sched)
    assert sched.abort_request("wait").status is RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("run") is not None
    assert sched.abort_request("run") is None
    assert kv.num_free_blocks == 16 and not sched.has_unfinished_requests()
