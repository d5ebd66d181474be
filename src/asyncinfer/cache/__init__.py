"""The engine's memory system: block pool, prefix cache and per-request block tables (plain Python).

Only :mod:`asyncinfer.cache.kv_tensors` touches torch (it allocates and copies
the physical K/V tensors); it is not imported here.
"""

from asyncinfer.cache.block_pool import BlockPool, KVBlock
from asyncinfer.cache.kv_manager import RELEASED_BLOCK, KVCacheManager, KVCacheStats, blocks_for
from asyncinfer.cache.prefix import NO_HIT, PrefixHit

__all__ = [
    "NO_HIT",
    "RELEASED_BLOCK",
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "KVCacheStats",
    "PrefixHit",
    "blocks_for",
]
