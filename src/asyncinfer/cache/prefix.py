"""Prefix-cache keys: chained block hashes and the result of a lookup (plain Python).

Block ``j`` of a request is keyed by ``hash((hash of block j-1, token ids of block j))``;
the chain starts at ``hash((ROOT, cache_salt))`` (``hash((ROOT, (cache_salt, group)))`` where the
cache manager groups requests), so requests with different salts or groups
never share a block (tenants can be kept apart). The hash finds a candidate;
:class:`~asyncinfer.cache.block_pool.BlockPool` verifies token ids and parent
link, so a collision costs a miss, never a wrong reuse.

The default hash is Python's ``hash`` of a tuple: fast and stable within one
process (the salt's string hash depends on the process's hash seed, which is
fine: the cache lives in one process). Pass another ``hash_fn`` to
:class:`~asyncinfer.cache.KVCacheManager` (tests pass a deliberately weak one).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

HashFn = Callable[[tuple], int]

#: Marks the start of every chain; with the salt it is the first block's parent.
ROOT = "asyncinfer-prefix-root"


def root_link(salt: Hashable) -> tuple[str, Hashable]:
    """The parent link of a chain's first block."""
    return (ROOT, salt)


def root_hash(salt: Hashable, hash_fn: HashFn = hash) -> int:
    return hash_fn(root_link(salt))


def chain_hash(parent_hash: int, token_ids: tuple[int, ...], hash_fn: HashFn = hash) -> int:
    return hash_fn((parent_hash, token_ids))


def block_tokens(token_ids: Sequence[int], index: int, block_size: int) -> tuple[int, ...]:
    """The token ids of full block ``index``."""
    return tuple(token_ids[index * block_size : (index + 1) * block_size])


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest cached chain for a request, found by ``KVCacheManager.lookup_prefix``.

    Read-only: nothing is held until it is passed to ``allocate``, which must
    happen before any other allocation (an eviction in between makes it stale,
    and ``allocate`` refuses a stale hit with ``ValueError``).
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    hashes: tuple[int, ...] = ()
    links: tuple[Hashable, ...] = ()

    def __bool__(self) -> bool:
        return self.num_tokens > 0


NO_HIT = PrefixHit()
