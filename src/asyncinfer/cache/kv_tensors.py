"""The one place that allocates the physical KV tensors (the rest of cache/ is plain Python)."""

from __future__ import annotations

import torch

from asyncinfer.cache.spec import KVCacheSpec


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Preallocate K and V for every layer, ``spec.layer_shape(num_blocks)`` each.

    Zero-filled rather than empty: attention masks padded slots, and a masked
    probability of 0 times a garbage NaN would still be NaN.
    """
    shape = spec.layer_shape(num_blocks)  # [num_blocks, block_size, num_kv_heads, head_dim]
    return [
        (
            torch.zeros(shape, dtype=spec.dtype, device=spec.device),  # [num_blocks, block_size, kv_heads, head_dim]
            torch.zeros(shape, dtype=spec.dtype, device=spec.device),  # [num_blocks, block_size, kv_heads, head_dim]
        )
        for _ in range(spec.num_layers)
    ]


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's K and V (copy-on-write).

    All sources are read before any destination is written, so the pairs see
    the blocks as they were before the call; no ``dst`` may repeat.
    """
    if not pairs:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)  # [num_pairs]
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)  # [num_pairs]
    for k_cache, v_cache in kv_caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))  # [num_pairs, block_size, kv_heads, head_dim]
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))  # [num_pairs, block_size, kv_heads, head_dim]
