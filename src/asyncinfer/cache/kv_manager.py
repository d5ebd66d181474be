"""Per-request block tables over the block pool: the verbs schedulers use.

Plain Python. A request's table covers exactly ``ceil(tokens / block_size)``
blocks for the tokens it has asked slots for, so the waste is at most one
partial block per request. A failed allocation changes nothing and returns
``False``; it never raises from inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncinfer.cache.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` slots."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the cache's figures (later exported as metrics)."""

    num_blocks: int
    used_blocks: int
    free_blocks: int
    usage: float
    allocated_slots: int
    filled_slots: int
    preemptions: int

    @property
    def waste(self) -> float:
        """Fraction of allocated slots that hold no token (partial last blocks)."""
        if self.allocated_slots == 0:
            return 0.0
        return 1.0 - self.filled_slots / self.allocated_slots


class KVCacheManager:
    """Owns the block pool and every request's block table.

    Verbs for schedulers: :meth:`can_allocate`, :meth:`allocate_slots`,
    :meth:`free`, :meth:`num_free_blocks`. ``watermark_blocks`` free blocks are
    kept back from *new* admissions so that running decodes do not stall at once.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.watermark_blocks = int(num_blocks * watermark)
        self._tables: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}  # token slots each request has asked for
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_needed(self, request_id: str, total_tokens: int) -> int:
        """Extra blocks a request needs for its table to cover ``total_tokens`` slots."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_for(total_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, total_tokens: int, *, new_request: bool = False) -> bool:
        """Whether :meth:`allocate_slots` would succeed (new requests respect the watermark)."""
        need = self.num_blocks_needed(request_id, total_tokens)
        reserve = self.watermark_blocks if new_request else 0
        return need + reserve <= self.pool.num_free_blocks

    # ---------------------------------------------------------------- mutations
    def allocate_slots(self, request_id: str, total_tokens: int, *, new_request: bool = False) -> bool:
        """Grow the request's table to cover ``total_tokens`` slots; ``False`` changes nothing."""
        if not self.can_allocate(request_id, total_tokens, new_request=new_request):
            return False
        need = self.num_blocks_needed(request_id, total_tokens)
        new_blocks = self.pool.allocate(need)
        assert new_blocks is not None  # can_allocate checked the count
        self._tables.setdefault(request_id, []).extend(new_blocks)
        self._num_slots[request_id] = max(self._num_slots.get(request_id, 0), total_tokens)
        return True

    def free(self, request_id: str) -> None:
        """Return every block of the request (idempotent: freeing twice is a no-op)."""
        table = self._tables.pop(request_id, None)
        self._num_slots.pop(request_id, None)
        if table:
            # Reverse order: a request's last blocks are the least likely to be
            # shared, so they should be the first ones reused.
            self.pool.free(reversed(table))

    def preempt(self, request_id: str) -> None:
        """Free a running request's blocks so it can be recomputed later."""
        self.free(request_id)
        self.num_preemptions += 1

    def stats(self) -> KVCacheStats:
        used = self.pool.num_used_blocks
        allocated = sum(len(t) for t in self._tables.values()) * self.block_size
        return KVCacheStats(
            num_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=self.pool.num_free_blocks,
            usage=used / self.num_blocks,
            allocated_slots=allocated,
            filled_slots=sum(self._num_slots.values()),
            preemptions=self.num_preemptions,
        )
