"""Prefix caching, copy-on-write forks and the step protocol of KVCacheManager, case by case."""

from __future__ import annotations

import pytest

from asyncinfer.cache import NO_HIT, KVCacheManager
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.step import advance


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), arrival_time=0.0, cache_salt=salt)


def manager(num_blocks: int = 16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, watermark=0.0, enable_prefix_caching=True, **kw)


def run(kv: KVCacheManager, request: Request, n: int, prefix=None) -> None:
    """Admit/grow and 'compute' as the core would (commit, then advance the counter)."""
    assert kv.allocate(request, n, prefix=prefix)
    if prefix:
        request.num_computed_tokens = prefix.num_tokens
    kv.commit_step()
    advance([(request, n)])


def test_second_request_reuses_the_full_blocks_of_the_first() -> None:
    kv = manager()
    a = req("a", range(10))
    run(kv, a, 10)
    b = req("b", [*range(8), 50, 51, 52])
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 8 and list(hit.block_ids) == kv.block_table("a")[:2]
    run(kv, b, 3, prefix=hit)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert [kv.pool.blocks[x].ref_cnt for x in kv.block_table("b")] == [2, 2, 1]
    stats = kv.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (10 + 11, 8)
    assert stats.used_blocks == 4  # 3 of a + 1 of b; the shared two count once
    assert stats.filled_slots == 10 + 3 and stats.allocated_slots == 16


def test_hits_leave_the_last_token_to_compute() -> None:
    kv = manager()
    run(kv, req("a", range(8)), 8)  # exactly two full blocks
    assert kv.lookup_prefix(req("b", range(8))).num_tokens == 4  # not 8: logits need a computed token
    assert kv.lookup_prefix(req("c", range(9))).num_tokens == 8


def test_freed_blocks_stay_cached_until_evicted() -> None:
    kv = manager(num_blocks=4)
    run(kv, req("a", range(9)), 9)
    kv.free("a")
    stats = kv.stats()
    assert (stats.used_blocks, stats.cached_free_blocks, stats.free_blocks) == (0, 2, 4)
    assert kv.lookup_prefix(req("b", range(9))).num_tokens == 8
    # Free queue: the never-used block, then a's blocks last to first (a frees in reverse),
    # so a's first block, the root of its chain, is evicted last.
    assert kv.allocate_slots("hog", 12)  # 3 blocks: the unused one, a's partial one, a's second
    assert kv.lookup_prefix(req("c", range(9))).num_tokens == 4
    assert kv.stats().evictions == 1
    kv.free("hog")
    assert kv.allocate_slots("hog2", 16)
    assert kv.lookup_prefix(req("d", range(9))) == NO_HIT


def test_salts_keep_tenants_apart() -> None:
    kv = manager()
    run(kv, req("a", range(9), salt="tenant-1"), 9)
    assert kv.lookup_prefix(req("b", range(9))) == NO_HIT
    assert kv.lookup_prefix(req("c", range(9), salt="tenant-2")) == NO_HIT
    assert kv.lookup_prefix(req("d", range(9), salt="tenant-1")).num_tokens == 8


def test_a_colliding_hash_never_reuses_other_tokens() -> None:
    kv = manager(hash_fn=lambda key: 0)  # every block has the same hash
    run(kv, req("a", [1, 1, 1, 1, 2, 2, 2, 2, 9]), 9)
    assert kv.lookup_prefix(req("b", [3, 3, 3, 3, 2, 2, 2, 2, 9])) == NO_HIT
    assert kv.lookup_prefix(req("c", [1, 1, 1, 1, 5])).num_tokens == 4


def test_reset_prefix_cache_forgets_and_in_flight_requests_stop_registering() -> None:
    kv = manager()
    a = req("a", range(6))
    run(kv, a, 6)
    assert kv.reset_prefix_cache() == 1
    assert kv.lookup_prefix(req("b", range(6))) == NO_HIT
    a.output_token_ids.extend([6, 7, 8])
    run(kv, a, 3)  # fills blocks 1 and 2 after the reset
    assert kv.stats().cached_blocks == 0
    c = req("c", range(9))
    run(kv, c, 9)  # a request started after the reset registers again
    assert kv.lookup_prefix(req("d", range(10))).num_tokens == 8


def test_fork_shares_then_copies_on_first_divergent_write() -> None:
    kv = manager()
    parent = req("p", range(6))
    run(kv, parent, 6)
    child = req("p#1", range(6))
    child.num_computed_tokens = 6
    free = kv.num_free_blocks
    kv.fork("p", child, 6)
    assert kv.block_table("p#1") == kv.block_table("p") and kv.num_free_blocks == free
    shared_partial = kv.block_table("p")[1]
    # The child writes position 6 into the shared, half-full block: it gets a copy.
    child.output_token_ids.append(40)
    assert kv.num_blocks_needed(child, 7) == 1
    assert kv.append_slots(child, 1)
    assert kv.block_table("p#1")[0] == kv.block_table("p")[0]  # the full block stays shared
    copy = kv.block_table("p#1")[1]
    assert copy != shared_partial
    assert kv.commit_step() == [(shared_partial, copy)]
    assert kv.commit_step() == []
    # The parent is now the only holder: it writes in place, no copy.
    parent.output_token_ids.append(41)
    assert kv.append_slots(parent, 1)
    assert kv.block_table("p")[1] == shared_partial and kv.commit_step() == []
    assert kv.stats().cow_copies == 1


def test_copy_on_write_that_does_not_fit_changes_nothing() -> None:
    kv = manager(num_blocks=2)
    parent = req("p", range(6))
    run(kv, parent, 6)
    kv.fork("p", "p#1")
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots("p#1", 7)  # needs a copy, no block is free
    assert kv.block_table("p#1") == kv.block_table("p") and kv.commit_step() == []


def test_commit_step_returns_copies_that_read_the_old_contents() -> None:
    kv = manager()
    kv._copies = [(1, 2), (2, 3), (4, 2)]  # 2 <- 1, then 3 <- 2 (i.e. 1), then 2 <- 4
    assert sorted(kv.commit_step()) == [(1, 3), (4, 2)]


def test_a_request_admitted_in_the_same_step_shares_blocks_being_computed() -> None:
    kv = manager()
    a, b = req("a", range(10)), req("b", range(10))
    assert kv.allocate(a, 10)  # registers blocks 0 and 1, computed by this step's forward
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 8
    assert kv.allocate(b, 2, prefix=hit)
    b.num_computed_tokens = 8
    # Freeing a before the step ran would leave b reading blocks nobody computes.
    with pytest.raises(RuntimeError, match="preempt before you admit"):
        kv.free("a")
    kv.commit_step()
    kv.free("a")  # after the step: fine, b keeps the blocks
    assert kv.lookup_prefix(req("c", range(10))).num_tokens == 8


def test_blocks_of_a_step_that_never_ran_leave_the_cache() -> None:
    kv = manager()
    assert kv.allocate(req("a", range(10)), 10)
    kv.free("a")  # dropped in the step that scheduled it: its blocks were never computed
    kv.commit_step()
    assert kv.lookup_prefix(req("b", range(10))) == NO_HIT


def test_stale_hit_is_refused() -> None:
    kv = manager(num_blocks=3)
    run(kv, req("a", range(5)), 5)
    kv.free("a")
    hit = kv.lookup_prefix(req("b", range(5)))
    assert hit.num_tokens == 4
    assert kv.allocate_slots("hog", 12)  # evicts the cached block
    kv.free("hog")
    with pytest.raises(ValueError, match="stale"):
        kv.allocate(req("b", range(5)), 1, prefix=hit)


def test_caching_off_by_default_in_a_bare_manager() -> None:
    kv = KVCacheManager(8, 4)
    run(kv, req("a", range(9)), 9)
    assert kv.lookup_prefix(req("b", range(9))) == NO_HIT and kv.stats().cached_blocks == 0
