"""KVCacheManager with prefix caching and copy-on-write, against a model (Hypothesis state machine).

Besides the books (who owns which block, ref counts, free + used == total), the
machine keeps a *shadow* of the physical KV tensors: every slot holds the
identity of the key/value written there, i.e. the salt and the whole token
prefix up to that position. Each step applies the manager's copy-on-write
pairs and writes the scheduled tokens through the block tables, exactly as the
runner would. The invariant "every computed position of every live request
reads its own identity" then catches any wrong prefix hit, any missing or
misplaced copy, and any write into a block that somebody else still reads.
The second machine runs the same rules with a hash that collides all the
time, so only the verification of token ids and parent links keeps hits right.
The third runs them with a sliding window (drawn per run): each allocation gives
back the blocks wholly before the window of the request's next query, the
positions still in the window must read their own identity, released entries
hold :data:`RELEASED_BLOCK`, and the counts stay exact (a block given back counts
as freed in the same allocation).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncinfer.cache import NO_HIT, RELEASED_BLOCK, KVCacheManager, blocks_for
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.step import advance

BS = 4
NUM_BLOCKS = 16
SYSTEMS = [(1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (5, 5, 5, 5, 5)]
PARAMS = SamplingParams(max_tokens=64)

suffixes = st.lists(st.integers(0, 3), max_size=9)
salts = st.sampled_from([None, None, "tenant-b"])
fractions = st.floats(0.05, 1.0)


def chunk(want: int, fraction: float) -> int:
    return max(1, min(want, round(want * fraction)))


class ManagerMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(hash)
    window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.kv = self._manager()
        self.live: dict[str, Request] = {}
        self.preempted: dict[str, Request] = {}
        self.freed: list[str] = []
        self.phys: list[list[object]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.count = 0

    # ---------------------------------------------------------------- helpers
    def _manager(self) -> KVCacheManager:
        return KVCacheManager(NUM_BLOCKS, BS, watermark=0.0, enable_prefix_caching=True, hash_fn=self.hash_fn,
                              sliding_window=self.window)

    def _dead(self, start: int) -> int:
        """Blocks wholly before the window of a query at ``start`` (the model's own count)."""
        return 0 if self.window is None else max(0, start - self.window + 1) // BS

    def _request(self, tokens: list[int], salt: str | None) -> Request:
        self.count += 1
        return Request(f"r{self.count}", list(tokens), PARAMS, arrival_time=0.0, cache_salt=salt)

    @staticmethod
    def _identity(request: Request, position: int) -> tuple:
        return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))

    def _snapshot(self) -> tuple:
        kv, pool = self.kv, self.kv.pool
        tables = {rid: (list(kv.block_table(rid)), kv.num_slots(rid), kv.num_released_blocks(rid))
                  for rid in kv.request_ids()}
        blocks = [(b.ref_cnt, b.block_hash, b.token_ids, b.parent, b.prefix_id) for b in pool.blocks]
        return tables, pool.free_block_ids(), blocks, dict(kv._pending), list(kv._copies), kv.stats()

    def _run(self, scheduled: list[tuple[Request, int]]) -> None:
        """One engine step: apply copy-on-write, then write every scheduled token's identity."""
        copies = self.kv.commit_step()
        assert len({dst for _, dst in copies}) == len(copies)
        before = {src: list(self.phys[src]) for src, _ in copies}
        for src, dst in copies:
            self.phys[dst] = list(before[src])
        for request, n in scheduled:
            table = self.kv.block_table(request.request_id)
            for p in range(request.num_computed_tokens, request.num_computed_tokens + n):
                self.phys[table[p // BS]][p % BS] = self._identity(request, p)
        advance(scheduled)

    def _admit(self, request: Request, fraction: float) -> int:
        """Prefix lookup + allocation as a scheduler admits a waiting request; 0 if it does not fit."""
        hit = self.kv.lookup_prefix(request)
        assert hit.num_tokens % BS == 0 and hit.num_tokens < request.num_tokens
        start = hit.num_tokens
        n = chunk(request.num_tokens - start, fraction)
        dead = min(self._dead(start), len(hit.block_ids))  # hit blocks before the window are never taken
        revived = sum(1 for b in hit.block_ids[dead:] if self.kv.pool.blocks[b].ref_cnt == 0)
        need = blocks_for(start + n, BS) - len(hit.block_ids) + revived
        free = self.kv.num_free_blocks
        before = self._snapshot()
        ok = self.kv.allocate(request, n, prefix=hit or None)
        assert ok == (need <= free), "k free blocks must satisfy an allocation of k (no fragmentation)"
        if not ok:
            assert self._snapshot() == before, "a failed allocation changed the manager"
            return 0
        assert self.kv.num_released_blocks(request.request_id) == dead
        request.num_computed_tokens = start
        return n

    # ------------------------------------------------------------------ rules
    @rule(system=st.sampled_from(SYSTEMS), suffix=suffixes, salt=salts, fraction=fractions)
    def add(self, system: tuple[int, ...], suffix: list[int], salt: str | None, fraction: float) -> None:
        request = self._request([*system, *suffix], salt)
        n = self._admit(request, fraction)
        if n:
            self.live[request.request_id] = request
            self._run([(request, n)])

    @rule(system=st.sampled_from(SYSTEMS), suffix=suffixes)
    def share_a_prefix_in_one_step(self, system: tuple[int, ...], suffix: list[int]) -> None:
        """Two identical prompts admitted in one step: the second shares blocks the first is computing."""
        a = self._request([*system, *suffix], None)
        b = self._request([*system, *suffix], None)
        na = self._admit(a, 1.0)
        if not na:
            return
        self.live[a.request_id] = a
        hit = self.kv.lookup_prefix(b)
        if self.hash_fn is hash and self.window is None:  # a window leaves a hit's early blocks evictable
            assert hit.num_tokens == (b.num_tokens - 1) // BS * BS
        nb = self._admit(b, 1.0)
        if nb:
            self.live[b.request_id] = b
        self._run([(a, na)] + ([(b, nb)] if nb else []))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3), fraction=fractions)
    def step(self, data: st.DataObject, token: int, fraction: float) -> None:
        """A running request computes a chunk of what it lacks, or samples a token and computes it."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(token)
        self._grow(request, chunk(request.num_uncomputed_tokens, fraction))

    def _grow(self, request: Request, n: int) -> bool:
        """``append_slots`` for ``n`` tokens, checked against the model's count, then the step that computes them."""
        rid = request.request_id
        table = list(self.kv.block_table(rid))
        slots = self.kv.num_slots(rid)
        released = self.kv.num_released_blocks(rid)
        total = request.num_computed_tokens + n
        dead = self._dead(request.num_computed_tokens)
        copies = sum(
            1 for i in range(max(slots // BS, dead), min(len(table), blocks_for(total, BS)))
            if self.kv.pool.blocks[table[i]].ref_cnt > 1
        )
        given_back = sum(1 for b in table[released:dead] if self.kv.pool.blocks[b].ref_cnt == 1)
        need = max(0, blocks_for(total, BS) - len(table)) + copies - given_back
        free = self.kv.num_free_blocks
        before = self._snapshot()
        ok = self.kv.append_slots(request, n)
        assert ok == (need <= free), "k free blocks (with those given back) must satisfy an allocation of k"
        if ok:
            assert self.kv.num_released_blocks(rid) == max(released, min(dead, len(table)))
            assert self.kv.num_free_blocks == free - need
            self._run([(request, n)])
        else:
            assert self._snapshot() == before, "a failed allocation changed the manager"
        return ok

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.live.values()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """``n > 1``: a sample that caught up is forked; the copy shares every block."""
        ready = sorted(rid for rid, r in self.live.items() if r.num_computed_tokens == r.num_tokens)
        parent = self.live[data.draw(st.sampled_from(ready))]
        child = self._request(parent.all_token_ids, parent.cache_salt)
        child.num_computed_tokens = parent.num_computed_tokens
        free = self.kv.num_free_blocks
        self.kv.fork(parent.request_id, child, parent.num_computed_tokens)
        assert self.kv.block_table(child.request_id) == self.kv.block_table(parent.request_id)
        assert self.kv.num_free_blocks == free  # forking takes no memory
        self.live[child.request_id] = child
        self._run([])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.finish_id(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: any(r.num_computed_tokens < r.num_prompt_tokens for r in self.live.values()))
    @rule(data=st.data())
    def abort_mid_prefill(self, data: st.DataObject) -> None:
        prefilling = sorted(rid for rid, r in self.live.items() if r.num_computed_tokens < r.num_prompt_tokens)
        self.finish_id(data.draw(st.sampled_from(prefilling)))

    def finish_id(self, rid: str) -> None:
        self.kv.free(rid)
        del self.live[rid]
        self.freed.append(rid)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_twice(self, data: st.DataObject) -> None:
        before = self._snapshot()
        self.kv.free(data.draw(st.sampled_from(self.freed)))
        assert self._snapshot() == before, "freeing twice changed something"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live.pop(rid)
        self.kv.preempt(rid)
        request.num_computed_tokens = 0
        self.preempted[rid] = request

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), fraction=fractions)
    def readmit(self, data: st.DataObject, fraction: float) -> None:
        rid = data.draw(st.sampled_from(sorted(self.preempted)))
        request = self.preempted[rid]
        n = self._admit(request, fraction)
        if n:
            self.live[rid] = self.preempted.pop(rid)
            self._run([(request, n)])

    @rule(system=st.sampled_from(SYSTEMS), suffix=suffixes)
    def drop_in_the_step_that_scheduled_it(self, system: tuple[int, ...], suffix: list[int]) -> None:
        """Blocks registered for a step that never ran must leave the cache with their request."""
        request = self._request([*system, *suffix], None)
        cached_before = self.kv.lookup_prefix(request).num_tokens
        if not self._admit(request, 1.0):
            return
        self.kv.free(request.request_id)
        self._run([])
        probe = self._request(request.all_token_ids, None)
        assert self.kv.lookup_prefix(probe).num_tokens <= cached_before

    @rule(data=st.data())
    def evict_everything_free(self, data: st.DataObject) -> None:
        """Take k free blocks (cached ones included): must succeed; scribble over them; give them back."""
        k = data.draw(st.integers(0, self.kv.num_free_blocks))
        self.count += 1
        rid = f"hog{self.count}"
        assert self.kv.allocate_slots(rid, k * BS), "k free blocks did not satisfy k"
        for b in self.kv.block_table(rid):
            self.phys[b] = [("scribble", rid)] * BS
        self.kv.free(rid)
        self._run([])

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
        assert self.kv.pool.num_cached_blocks == 0
        for system in SYSTEMS:
            assert self.kv.lookup_prefix(self._request([*system, 0, 0, 0, 0], None)) == NO_HIT

    # ------------------------------------------------------------- invariants
    @invariant()
    def books_balance(self) -> None:
        kv, pool = self.kv, self.kv.pool
        assert set(kv.request_ids()) == set(self.live), "a table without a live request, or the reverse"
        owners = [0] * NUM_BLOCKS
        for rid in self.live:
            released = kv.num_released_blocks(rid)
            table = kv.block_table(rid)
            assert table[:released] == [RELEASED_BLOCK] * released
            held = table[released:]
            assert len(held) == len(set(held)) == kv.num_held_blocks(rid), "a table holds a block twice"
            for b in held:
                owners[b] += 1
        for block in pool.blocks:
            assert block.ref_cnt == owners[block.block_id], "ref count differs from the live owners"
            assert pool.is_free(block.block_id) == (block.ref_cnt == 0), "free and owned, or neither"
        distinct_used = sum(1 for c in owners if c)
        assert pool.num_free_blocks + distinct_used == NUM_BLOCKS
        assert pool.num_cached_free_blocks == sum(1 for b in pool.blocks if b.is_cached and b.ref_cnt == 0)
        stats = kv.stats()
        assert stats.used_blocks == distinct_used and stats.free_blocks == pool.num_free_blocks

    @invariant()
    def tables_are_exact(self) -> None:
        for rid, request in self.live.items():
            slots = self.kv.num_slots(rid)
            assert slots == request.num_computed_tokens <= request.num_tokens
            assert len(self.kv.block_table(rid)) == blocks_for(slots, BS)
            # Nothing the next query's window reads was given back.
            assert self.kv.num_released_blocks(rid) <= self._dead(request.num_computed_tokens)

    @invariant()
    def every_computed_position_reads_its_own_kv(self) -> None:
        for rid, request in self.live.items():
            table = self.kv.block_table(rid)
            for p in range(self.kv.num_released_blocks(rid) * BS, request.num_computed_tokens):
                assert self.phys[table[p // BS]][p % BS] == self._identity(request, p), (
                    f"{rid} position {p} reads another sequence's KV"
                )

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        for block in self.kv.pool.blocks:
            if block.is_cached:
                slots = self.phys[block.block_id]
                assert all(s is not None and s[0] != "scribble" for s in slots)
                assert tuple(s[1][-1] for s in slots) == block.token_ids

    def teardown(self) -> None:
        for rid in list(self.live):
            self.kv.free(rid)
        stats = self.kv.stats()
        assert stats.used_blocks == 0 and stats.free_blocks == NUM_BLOCKS, "blocks leaked"


class CollidingHashMachine(ManagerMachine):
    """Four hash values in all: hits stay right only because they are verified."""

    hash_fn = staticmethod(lambda key: hash(key) & 3)


class WindowMachine(ManagerMachine):
    """The same rules with a sliding window: blocks wholly before it go back as requests grow."""

    window = 5

    @initialize(window=st.sampled_from([1, 3, 4, 5, 8]))
    def pick_window(self, window: int) -> None:
        self.window = window
        self.kv = self._manager()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def decode(self, data: st.DataObject, tokens: list[int]) -> None:
        """A request computes what it lacks, then decodes token by token: past the window it holds at most
        ``ceil((W - 1) / BS) + 1`` blocks after each allocation."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_uncomputed_tokens and not self._grow(request, request.num_uncomputed_tokens):
            return
        assert self.window is not None
        bound = -(-(self.window - 1) // BS) + 1
        for token in tokens:
            request.output_token_ids.append(token)
            if not self._grow(request, 1):
                return
            assert self.kv.num_held_blocks(request.request_id) <= bound


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
TestCollidingHashMachine = CollidingHashMachine.TestCase
TestCollidingHashMachine.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)
TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
