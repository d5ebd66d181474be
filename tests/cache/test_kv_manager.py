"""Block pool and KV manager: exact block counts, no leaks, failed allocations change nothing."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncinfer.cache import BlockPool, KVCacheManager, blocks_for


def test_blocks_for() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_pool_reuses_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [0, 1] and b == [2, 3]
    assert pool.allocate(1) is None
    pool.free([3])
    pool.free([0])
    assert pool.allocate(2) == [3, 0]


def test_pool_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_manager_grows_tables_exactly() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, watermark=0.0)
    assert kv.allocate_slots("a", 5)
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots("a", 8)  # still fits in 2 blocks
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots("a", 9)
    assert len(kv.block_table("a")) == 3
    stats = kv.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.allocated_slots, stats.filled_slots) == (3, 7, 12, 9)
    kv.free("a")
    kv.free("a")  # idempotent
    assert kv.num_free_blocks == 10


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, watermark=0.0)
    assert kv.allocate_slots("a", 8)
    before = (kv.block_table("a"), kv.num_free_blocks)
    assert not kv.allocate_slots("b", 9)
    assert kv.block_table("b") == []
    assert (kv.block_table("a"), kv.num_free_blocks) == before


def test_watermark_only_limits_new_requests() -> None:
    kv = KVCacheManager(num_blocks=100, block_size=1, watermark=0.05)
    assert kv.allocate_slots("run", 90)
    assert not kv.allocate_slots("new", 6, new_request=True)  # would dip into the 5-block watermark
    assert kv.allocate_slots("run", 96)  # running requests may use it


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/grow/free sequences against a simple model of who owns what."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=4, watermark=0.0)
        self.tokens: dict[str, int] = {}
        self.next_id = 0

    @rule(n=st.integers(1, 40))
    def allocate(self, n: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.kv.num_free_blocks
        ok = self.kv.allocate_slots(rid, n)
        assert ok == (blocks_for(n, 4) <= free_before)  # never fragmented: k free blocks always suffice
        if ok:
            self.tokens[rid] = n
        else:
            assert self.kv.num_free_blocks == free_before and self.kv.block_table(rid) == []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 12))
    def grow(self, data: st.DataObject, extra: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.kv.allocate_slots(rid, self.tokens[rid] + extra):
            self.tokens[rid] += extra

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid]

    @invariant()
    def books_balance(self) -> None:
        owned = [b for rid in self.tokens for b in self.kv.block_table(rid)]
        assert len(owned) == len(set(owned)), "a block has two owners"
        assert not any(self.kv.pool.is_free(b) for b in owned), "a block is free and owned"
        assert len(owned) + self.kv.num_free_blocks == self.kv.num_blocks
        for rid, n in self.tokens.items():
            assert len(self.kv.block_table(rid)) == blocks_for(n, 4)

    def teardown(self) -> None:
        for rid in list(self.tokens):
            self.kv.free(rid)
        assert self.kv.num_free_blocks == self.kv.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
