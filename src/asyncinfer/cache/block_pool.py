"""The pool of fixed-size KV blocks, created once at start-up.

Plain Python: no torch here. A block is an index into the physical KV tensors
(allocated elsewhere, once); this module only decides who owns which index.

Invariants (checked by the property tests in ``tests/cache``):
- every block is either in the free queue (``ref_cnt == 0``) or owned (``ref_cnt > 0``), never both;
- ``num_free + num_used == num_blocks``;
- freed blocks are reused in least-recently-freed order (the free queue is FIFO),
  which is what keeps recently freed, possibly cached, blocks around longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    """One block of ``block_size`` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0
    # Set when the block is full and registered in the prefix cache; kept after
    # the block is freed so that a later request can still hit it.
    block_hash: int | None = None


class BlockPool:
    """Fixed set of blocks with reference counts and an O(1) LRU free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion-ordered set of free block ids: popitem(last=False) is the
        # least recently freed block, and removal of a cached block on a
        # prefix hit is O(1) too.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # ---------------------------------------------------------------- mutations
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), or return ``None`` and change nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def share(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block, taking it out of the free queue if it was there."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    # ------------------------------------------------------------- prefix cache
    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, owned block under its content hash (first writer wins)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block_id

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (used blocks keep their contents, just not their reuse)."""
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
