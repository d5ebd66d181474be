"""The one place that allocates the physical KV tensors (the rest of cache/ is plain Python)."""

from __future__ import annotations

import math
import mmap
import sys

import torch

from asyncinfer.cache.spec import KVCacheSpec


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Preallocate K and V for every layer, ``spec.layer_shape(num_blocks)`` each.

    Zeros rather than garbage: attention masks padded slots, and a masked
    probability of 0 times a garbage NaN would still be NaN. On the CPU the
    zeros are an anonymous mapping of their own (:func:`_lazy_zeros`): the pages are mapped zero
    by the kernel and take physical memory only when a block is first written,
    so start-up neither spends seconds filling gigabytes nor holds them.
    """
    shape = spec.layer_shape(num_blocks)  # [num_blocks, block_size, num_kv_heads, head_dim]
    return [
        (_zeros(shape, spec), _zeros(shape, spec))  # K, V: [num_blocks, block_size, kv_heads, head_dim]
        for _ in range(spec.num_layers)
    ]


def _zeros(shape: tuple[int, ...], spec: KVCacheSpec) -> torch.Tensor:
    if spec.device.type == "cpu":
        return _lazy_zeros(shape, spec.dtype)
    return torch.zeros(shape, dtype=spec.dtype, device=spec.device)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose memory is committed page by page as it is written.

    Its own anonymous mapping: pages the kernel guarantees to be zero, untouched until written (``torch.zeros``
    writes every byte), and handed back to the system when the tensor is freed. Not ``calloc``: glibc serves a
    request below its mmap threshold, which rises to 32 MiB once the process has freed a large block, from heap
    memory it must clear, committing it all at once (a layer's K of the default model is 12 MiB). Private, not
    mmap's default ``MAP_SHARED``: a process forked after the engine was built gets its pages copied on write,
    never the parent's cache to write into and read. All-zero bits are 0.0 in every float dtype.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or sys.platform == "win32":  # (Windows' mmap takes no flags: no private anonymous mapping)
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8).view(dtype).view(shape)


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
