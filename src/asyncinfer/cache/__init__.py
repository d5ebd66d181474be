"""The engine's memory system: block pool and per-request block tables (plain Python)."""

from asyncinfer.cache.block_pool import BlockPool, KVBlock
from asyncinfer.cache.kv_manager import KVCacheManager, KVCacheStats, blocks_for

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "KVCacheStats", "blocks_for"]
