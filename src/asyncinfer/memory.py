"""Memory planning: how many KV blocks fit, computed rather than guessed.

Per block: ``2 x layers x kv_heads x head_dim x block_size x dtype_bytes`` (K and V).
The budget is an explicit byte count, or a fraction of the memory that is free
after the weights (available RAM on CPU, free device memory on CUDA) minus an
activation reserve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncinfer.errors import ConfigurationError

GiB = 1024**3
MiB = 1024**2


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device`` without evicting anything."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block across all layers (the article's formula with seq_len = block_size)."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers the engine starts with; ``describe()`` prints them."""

    weight_bytes: int
    block_bytes: int
    num_blocks: int
    block_size: int
    kv_budget_bytes: int
    activation_reserve: int
    max_model_len: int

    @property
    def kv_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def kv_token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"weights {self.weight_bytes / MiB:.1f} MiB, KV cache {self.kv_bytes / MiB:.1f} MiB "
            f"({self.num_blocks} blocks x {self.block_size} tokens = {self.kv_token_capacity} tokens, "
            f"{self.block_bytes / 1024:.1f} KiB/block), activation reserve "
            f"{self.activation_reserve / MiB:.0f} MiB, max_model_len {self.max_model_len}"
        )


def plan_kv_cache(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    block_size: int,
    max_model_len: int,
    weight_bytes: int,
    kv_cache_memory: int | None,
    kv_cache_fraction: float,
    activation_reserve: int,
    free_bytes: int,
) -> MemoryPlan:
    """Size the KV cache; refuse, with numbers, a plan where one max-length request cannot fit.

    ``free_bytes`` is the memory free *after* the weights were placed.
    """
    block_bytes = kv_block_bytes(num_layers, num_kv_heads, head_dim, block_size, dtype_bytes)
    if kv_cache_memory is not None:
        budget = kv_cache_memory
        if budget > free_bytes:
            raise ConfigurationError(
                f"kv_cache_memory={budget} bytes ({budget / MiB:.1f} MiB) exceeds the "
                f"{free_bytes / MiB:.1f} MiB free after loading {weight_bytes / MiB:.1f} MiB of weights"
            )
    else:
        budget = int(max(0, free_bytes - activation_reserve) * kv_cache_fraction)
    num_blocks = budget // block_bytes
    need_blocks = -(-max_model_len // block_size)
    if num_blocks < need_blocks:
        raise ConfigurationError(
            f"the KV cache holds {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens "
            f"({budget / MiB:.1f} MiB at {block_bytes} bytes/block), but one request of max_model_len="
            f"{max_model_len} needs {need_blocks} blocks ({need_blocks * block_bytes / MiB:.1f} MiB). "
            f"Raise kv_cache_memory / kv_cache_fraction or lower max_model_len."
        )
    return MemoryPlan(
        weight_bytes=weight_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        block_size=block_size,
        kv_budget_bytes=budget,
        activation_reserve=activation_reserve,
        max_model_len=max_model_len,
    )
