"""Admission counts what a request really needs (issue 10, items 1 and 4): the blocks its
prefix-cache hit does not cover, and a seat of ``max_num_seqs`` for each of its samples."""

from __future__ import annotations

import pytest

from asyncinfer.cache import KVCacheManager
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers import SchedulerConfig, builtin_schedulers, create_scheduler
from asyncinfer.step import apply_step

SYSTEM = list(range(100, 116))  # a shared 16-token system prompt: 4 blocks of 4


def run_step(sched, plan=None):
    """Apply one step as the core does: schedule (unless ``plan`` is given), commit, apply."""
    plan = sched.schedule() if plan is None else plan
    sched.kv.commit_step()
    return apply_step(sched, plan, 0)


def make(rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n), arrival_time=0.0)


@pytest.mark.parametrize("spec", builtin_schedulers())
def test_a_prefix_hit_needs_only_the_blocks_it_lacks(spec: str) -> None:
    """8 blocks. A (system + 1 token) holds 5 after its prompt: 3 free. B (system + 5 tokens)
    needs 6 blocks, 4 of them cached: admitted with 2, where counting all 6 refused it."""
    kv = KVCacheManager(8, 4, watermark=0.0, enable_prefix_caching=True)
    sched = create_scheduler(spec, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32), kv)
    a, b = make("a", [*SYSTEM, 7]), make("b", [*SYSTEM, 8, 9, 10, 11, 12])
    sched.add_request(a)
    run_step(sched)
    assert kv.num_free_blocks == 3 and kv.stats().cached_blocks == 4
    sched.add_request(b)
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 5}
    assert b.num_computed_tokens == 16 and kv.block_table("b")[:4] == kv.block_table("a")[:4]
    assert kv.num_free_blocks == 1  # b took 2 new blocks; a's decode fitted in its 5th block
    run_step(sched, plan)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert kv.num_free_blocks == 8


def test_a_cached_free_prefix_costs_the_blocks_it_takes_off_the_free_queue() -> None:
    """The hit's blocks that nobody holds leave the free queue: they count, once each."""
    kv = KVCacheManager(6, 4, watermark=0.0, enable_prefix_caching=True)
    sched = create_scheduler("fifo", SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24), kv)
    sched.add_request(make("first", [*SYSTEM, 7], max_tokens=1))
    run_step(sched)  # done: its 4 full blocks stay cached, free
    assert kv.num_free_blocks == 6 and kv.stats().cached_free_blocks == 4
    sched.add_request(make("holder", [1, 2], max_tokens=2))
    run_step(sched)
    # 6 blocks: 4 cached free ones revived + 2 new, but only 5 are free while "holder" runs.
    again = make("again", [*SYSTEM, 1, 2, 3, 4, 5])
    sched.add_request(again)
    assert sched.schedule().num_scheduled_tokens == {"holder": 1}
    sched.kv.commit_step()
    assert kv.num_free_blocks == 5 and again.num_computed_tokens == 0
    sched.finish_requests([sched.requests["holder"]])
    assert sched.schedule().num_scheduled_tokens == {"again": 5}
    assert again.num_computed_tokens == 16 and kv.num_free_blocks == 0


@pytest.mark.parametrize("spec", builtin_schedulers())
def test_a_request_of_n_samples_takes_n_seats_from_its_admission(spec: str) -> None:
    kv = KVCacheManager(64, 4, watermark=0.0)
    sched = create_scheduler(spec, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=32), kv)
    wide, small, other = make("wide", [1, 2, 3], n=3), make("small", [4, 5]), make("other", [6, 7])
    for r in (small, wide, other):
        sched.add_request(r)
    assert sched.schedule().num_scheduled_tokens == {"small": 2}  # wide needs 3 seats; other waits behind it
    assert [r.num_seqs for r in (wide, small, other)] == [3, 1, 1] and sched.num_running_seqs == 1
