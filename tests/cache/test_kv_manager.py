"""Block pool and KV manager: exact block counts, no leaks, failed allocations change nothing."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncinfer.cache import RELEASED_BLOCK, BlockPool, KVCacheManager, blocks_for
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams


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


class WindowPoolMachine(RuleBasedStateMachine):
    """The same under a sliding window (window and block size drawn per run): requests grow chunk by chunk and
    give back the blocks wholly before their next query's window; an allocation of k blocks succeeds iff k are
    free counting the ones it gives back first, a failed one changes nothing, and every block comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.window, self.bs = 4, 4
        self.kv = KVCacheManager(num_blocks=24, block_size=self.bs, watermark=0.0, sliding_window=self.window)
        self.requests: dict[str, Request] = {}
        self.dead: dict[str, int] = {}  # the blocks each table gave back at its latest allocation
        self.released_by_the_freed = 0
        self.next_id = 0

    @initialize(window=st.integers(1, 12), bs=st.sampled_from([1, 2, 4, 8]))
    def configure(self, window: int, bs: int) -> None:
        self.window, self.bs = window, bs
        self.kv = KVCacheManager(num_blocks=24, block_size=bs, watermark=0.0, sliding_window=window)

    @rule(n=st.integers(1, 40))
    def allocate(self, n: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(rid, [1] * n, SamplingParams(max_tokens=64), arrival_time=0.0)
        free = self.kv.num_free_blocks
        ok = self.kv.allocate(request, n)
        assert ok == (blocks_for(n, self.bs) <= free)
        if ok:
            request.num_computed_tokens = n
            self.requests[rid], self.dead[rid] = request, 0
        else:
            assert self.kv.num_free_blocks == free and self.kv.block_table(rid) == []

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), extra=st.integers(1, 12))
    def grow(self, data: st.DataObject, extra: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[rid]
        start = request.num_computed_tokens
        dead = max(0, start - self.window + 1) // self.bs
        table = list(self.kv.block_table(rid))
        given_back = len(table[self.dead[rid] : dead])  # nobody shares a block here
        need = max(0, blocks_for(start + extra, self.bs) - len(table)) - given_back
        free = self.kv.num_free_blocks
        ok = self.kv.append_slots(request, extra)
        assert ok == (need <= free), "k free blocks (with those given back) did not satisfy k"
        if ok:
            request.num_computed_tokens += extra
            self.dead[rid] = max(self.dead[rid], dead)
            assert self.kv.num_free_blocks == free - need
        else:
            assert self.kv.block_table(rid) == table and self.kv.num_free_blocks == free

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.kv.free(rid)
        self.released_by_the_freed += self.dead.pop(rid)
        del self.requests[rid]

    @invariant()
    def books_balance(self) -> None:
        owned = []
        for rid, request in self.requests.items():
            table = self.kv.block_table(rid)
            dead = self.dead[rid]
            assert self.kv.num_released_blocks(rid) == dead and table[:dead] == [RELEASED_BLOCK] * dead
            assert len(table) == blocks_for(request.num_computed_tokens, self.bs)
            owned += table[dead:]
        assert len(owned) == len(set(owned)), "a block has two owners"
        assert not any(self.kv.pool.is_free(b) for b in owned), "a block is free and owned"
        assert len(owned) + self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.stats().window_releases == sum(self.dead.values()) + self.released_by_the_freed

    def teardown(self) -> None:
        for rid in list(self.requests):
            self.kv.free(rid)
        assert self.kv.num_free_blocks == self.kv.num_blocks


TestWindowPoolMachine = WindowPoolMachine.TestCase
TestWindowPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
