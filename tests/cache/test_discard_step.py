"""KVCacheManager.discard_step: what a failed step leaves behind in the prefix cache and the copy queue."""

from __future__ import annotations

import pytest

from asyncinfer.cache import KVCacheManager
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams

PROMPT = list(range(10, 19))  # 9 tokens: 2 full blocks of 4 and one partial


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), arrival_time=0.0)


def test_a_failed_schedule_leaves_no_uncomputed_block_in_the_cache_and_no_copy_queued() -> None:
    kv = KVCacheManager(8, 4, watermark=0.0, enable_prefix_caching=True)
    a, b = make("a", PROMPT), make("b", [*PROMPT[:8], 99])
    assert kv.allocate(a, 9)  # registers a's 2 full blocks, to be computed by this step
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 8 and kv.allocate(b, 1, prefix=hit)  # admitted after a, in the same step
    with pytest.raises(RuntimeError, match="preempt before you admit"):
        kv.free("a")
    assert kv.discard_step(committed=False) == 2
    assert kv.stats().cached_blocks == 0 and not kv.lookup_prefix(make("c", PROMPT))
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_copies_queued_by_a_failed_schedule_are_dropped() -> None:
    kv = KVCacheManager(8, 4, watermark=0.0)
    parent = make("p", PROMPT)
    assert kv.allocate(parent, 9)
    kv.commit_step()
    kv.fork("p", "p#1", 9)  # shares the partial third block
    assert kv.allocate_slots("p#1", 10)  # its next token writes into it: copy-on-write queued
    assert kv.stats().cow_copies == 1
    kv.discard_step(committed=False)
    assert kv.commit_step() == []  # a stale pair would copy into a block the failed request gave back
    kv.free("p#1")
    kv.free("p")
    assert kv.num_free_blocks == 8


def test_after_the_commit_only_the_failed_steps_blocks_leave_the_cache() -> None:
    kv = KVCacheManager(8, 4, watermark=0.0, enable_prefix_caching=True)
    a = make("a", PROMPT)
    assert kv.allocate(a, 9)
    kv.commit_step()  # step 1 succeeds: a's 2 full blocks are computed
    b = make("b", list(range(50, 59)))
    assert kv.allocate(b, 9)
    kv.commit_step()  # step 2 is committed, then its forward pass fails
    assert kv.discard_step(committed=True) == 2
    assert kv.lookup_prefix(make("a2", PROMPT)).num_tokens == 8  # step 1's blocks stay cached
    assert not kv.lookup_prefix(make("b2", list(range(50, 59))))
