"""The pool of fixed-size KV blocks, created once at start-up.

Plain Python: no torch here. A block is an index into the physical KV tensors
(allocated elsewhere, once); this module only decides who owns which index and
which full blocks are known to the prefix cache.

Invariants (checked by the property tests in ``tests/cache``):
- every block is either in the free queue (``ref_cnt == 0``) or owned (``ref_cnt > 0``), never both;
- ``num_free_blocks + num_used_blocks == num_blocks``;
- freed blocks are reused in least-recently-freed order (the free queue is FIFO),
  which is what keeps recently freed, possibly cached, blocks around longest;
- a free block may still be *cached* (registered in the prefix cache): it counts
  as free, and taking it for something else evicts its registration.

Prefix-cache entries are exact. A block's registration holds its token ids and
a *parent link*: the ``prefix_id`` of the block before it in the chain (or
``("root", salt)`` for a first block). ``prefix_id`` values are handed out once
and never reused, so a lookup that checks token ids and parent link at every
block of a chain has matched the request's tokens exactly, whatever the hash
function does; the hash only finds the candidate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    """One block of ``block_size`` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0
    # Prefix-cache registration, set when the block is full (all None otherwise).
    # Kept after the block is freed so that a later request can still hit it;
    # dropped when the block is evicted (taken for new contents).
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: Hashable = None
    prefix_id: int | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class BlockPool:
    """Fixed set of blocks with reference counts, an O(1) LRU free queue and the prefix-cache index."""

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
        self._num_cached_free = 0
        self._next_prefix_id = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self._cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reusable until evicted)."""
        return self._num_cached_free

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they would be taken (least recently freed first)."""
        return list(self._free)

    # ---------------------------------------------------------------- mutations
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1 each), or return ``None`` and change nothing.

        Cached free blocks are evicted as they are taken, least recently freed first.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.is_cached:
                self._num_cached_free -= 1
                self._drop(block)
                self.num_evictions += 1
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
                if block.is_cached:
                    self._num_cached_free += 1

    def share(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block, taking it out of the free queue if it was there."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                if block.is_cached:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    # ------------------------------------------------------------- prefix cache
    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent: Hashable) -> int | None:
        """Enter a full, held block in the prefix cache; returns the link its successor uses.

        The link is the ``prefix_id`` of the entry that now stands for this
        content: the block's own, or that of an existing entry with the same
        token ids and parent (a duplicate: the block itself stays unregistered).
        An existing entry with the same hash but other contents (a collision,
        or an orphan whose chain was evicted) is replaced when nobody holds it;
        when it is held, the block stays unregistered and ``None`` is returned:
        the chain ends here for this request.
        """
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise RuntimeError(f"block {block_id} must be held to be registered")
        if block.is_cached:
            raise RuntimeError(f"block {block_id} is already registered")
        other_id = self._cached.get(block_hash)
        if other_id is not None:
            other = self.blocks[other_id]
            if other.token_ids == token_ids and other.parent == parent:
                return other.prefix_id
            if other.ref_cnt > 0:
                return None
            self.unregister(other_id)
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent = parent
        block.prefix_id = self._next_prefix_id
        self._next_prefix_id += 1
        self._cached[block_hash] = block_id
        return block.prefix_id

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: Hashable) -> KVBlock | None:
        """The cached block for this hash if its token ids and parent link match exactly."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent != parent:
            return None
        return block

    def unregister(self, block_id: int) -> None:
        """Forget one block's registration (no-op for an unregistered block)."""
        block = self.blocks[block_id]
        if not block.is_cached:
            return
        if block.ref_cnt == 0:
            self._num_cached_free -= 1
        self._drop(block)

    def reset_prefix_cache(self) -> int:
        """Forget every registration (held blocks keep their contents, just not their reuse).

        Returns the number of entries dropped.
        """
        dropped = len(self._cached)
        for block_id in list(self._cached.values()):
            self._drop(self.blocks[block_id])
        self._num_cached_free = 0
        return dropped

    def _drop(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.parent = None
        block.prefix_id = None
