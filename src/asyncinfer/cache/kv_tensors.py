"""The one place that allocates the physical KV tensors (the rest of cache/ is plain Python)."""

from __future__ import annotations

import torch


def allocate_kv_caches(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Preallocate K and V for every layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each.

    Zero-filled rather than empty: attention masks padded slots, and a masked
    probability of 0 times a garbage NaN would still be NaN.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
