"""BlockPool against a model of owners and of the free queue's order (Hypothesis state machine)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncinfer.cache import BlockPool

NUM_BLOCKS = 12


class PoolMachine(RuleBasedStateMachine):
    """Owners take, share and drop blocks; full blocks are registered, looked up and evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.owners: Counter[int] = Counter()  # block -> live references in the model
        self.free_order: list[int] = list(range(NUM_BLOCKS))  # expected LRU order
        self.entries: dict[int, tuple[int, tuple[int, ...], object]] = {}  # block -> (hash, tokens, parent)

    # ------------------------------------------------------------------ rules
    @rule(n=st.integers(0, NUM_BLOCKS + 2))
    def allocate(self, n: int) -> None:
        before = self._snapshot()
        got = self.pool.allocate(n)
        if n > len(self.free_order):
            assert got is None
            assert self._snapshot() == before, "a failed allocation changed the pool"
            return
        assert got == self.free_order[:n], "blocks are not taken least recently freed first"
        del self.free_order[:n]
        for b in got:
            self.owners[b] += 1
            self.entries.pop(b, None)  # taking a cached free block evicts it

    @precondition(lambda self: +self.owners)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = sorted(b for b, c in self.owners.items() if c)
        blocks = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True))
        self.pool.free(blocks)
        for b in blocks:
            self.owners[b] -= 1
            if self.owners[b] == 0:
                self.free_order.append(b)

    @precondition(lambda self: +self.owners)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(sorted(b for b, c in self.owners.items() if c)))
        self.pool.share([b])
        self.owners[b] += 1

    @precondition(lambda self: any(self.pool.blocks[b].is_cached for b in self.free_order))
    @rule(data=st.data())
    def revive_cached_free_block(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from([b for b in self.free_order if self.pool.blocks[b].is_cached]))
        self.pool.share([b])
        self.owners[b] += 1
        self.free_order.remove(b)

    @rule()
    def free_a_free_block_is_an_error(self) -> None:
        if self.free_order:
            with pytest.raises(RuntimeError, match="freed more often"):
                self.pool.free([self.free_order[0]])

    @precondition(lambda self: any(c and b not in self.entries for b, c in self.owners.items()))
    @rule(data=st.data(), h=st.integers(0, 5), tokens=st.tuples(st.integers(0, 2), st.integers(0, 2)),
          parent=st.sampled_from([None, 0, 1]))
    def register(self, data: st.DataObject, h: int, tokens: tuple[int, ...], parent: object) -> None:
        b = data.draw(st.sampled_from(sorted(b for b, c in self.owners.items() if c and b not in self.entries)))
        other = next((o for o, e in self.entries.items() if e[0] == h), None)
        link = self.pool.register(b, h, tokens, parent)
        if other is None:
            self.entries[b] = (h, tokens, parent)
            assert link == self.pool.blocks[b].prefix_id is not None
        elif self.entries[other][1:] == (tokens, parent):
            assert link == self.pool.blocks[other].prefix_id  # duplicate: link to the existing entry
            assert not self.pool.blocks[b].is_cached
        elif self.owners[other]:
            assert link is None and not self.pool.blocks[b].is_cached  # held collision: chain ends
        else:
            del self.entries[other]  # unheld collision or orphan: replaced
            self.entries[b] = (h, tokens, parent)
            assert link == self.pool.blocks[b].prefix_id is not None

    @rule(h=st.integers(0, 5), tokens=st.tuples(st.integers(0, 2), st.integers(0, 2)),
          parent=st.sampled_from([None, 0, 1]))
    def lookup_is_exact(self, h: int, tokens: tuple[int, ...], parent: object) -> None:
        found = self.pool.lookup(h, tokens, parent)
        expected = next((b for b, e in self.entries.items() if e == (h, tokens, parent)), None)
        assert (found.block_id if found else None) == expected

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache() == len(self.entries)
        self.entries.clear()

    def _snapshot(self) -> tuple:
        p = self.pool
        blocks = [(b.ref_cnt, b.block_hash, b.token_ids, b.parent, b.prefix_id) for b in p.blocks]
        return p.free_block_ids(), blocks, p.num_cached_free_blocks, p.num_evictions

    # ------------------------------------------------------------- invariants
    @invariant()
    def every_block_is_free_or_owned(self) -> None:
        for block in self.pool.blocks:
            assert block.ref_cnt == self.owners[block.block_id], "ref count differs from the owners"
            assert self.pool.is_free(block.block_id) == (block.ref_cnt == 0)
        assert self.pool.free_block_ids() == self.free_order
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == NUM_BLOCKS

    @invariant()
    def cache_index_matches(self) -> None:
        cached = {b.block_id for b in self.pool.blocks if b.is_cached}
        assert cached == set(self.entries)
        assert self.pool.num_cached_blocks == len(cached)
        assert self.pool.num_cached_free_blocks == sum(1 for b in cached if self.owners[b] == 0)
        for b, (h, tokens, parent) in self.entries.items():
            assert self.pool.lookup(h, tokens, parent) is self.pool.blocks[b]
        ids = [self.pool.blocks[b].prefix_id for b in cached]
        assert len(set(ids)) == len(ids), "two entries share a prefix id"

    def teardown(self) -> None:
        for b, c in list(self.owners.items()):
            self.pool.free([b] * c)
        assert self.pool.num_free_blocks == NUM_BLOCKS and self.pool.num_used_blocks == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
