"""Paged decode attention in Triton: one query token per sequence, K/V read from the cache's blocks in place.

:func:`paged_decode_attention` attends every sequence's one new query over its own context, reading each
key and value where the paged cache keeps it (``[num_blocks, block_size, num_kv_heads, head_dim]``, a
token's slot ``block_id * block_size + offset``) through the sequence's block table: no gather into a
contiguous tensor, no padding to the longest context, no mask tensor. Sequences of different context
lengths run in one launch; the query heads that share a KV head (grouped-query attention) are one
program, so each key and value block is loaded once for all of them.

The arithmetic is the SDPA backend's (:mod:`asyncinfer.models.attention.sdpa`): scores ``scale * q.k``
in float32 (soft-capped as ``softcap * tanh(scores / softcap)`` when asked), the query at position
``context_len - 1`` sees the keys ``0 .. context_len - 1`` (with a sliding ``window``, the last
``window`` of them only), a softmax in float32 (online, one KV block at a time), and the output cast to
the query's dtype. float32, bfloat16 and float16 caches; any block size (1..256) and head size.

Every argument is checked before the launch (:func:`check_decode_inputs`): shapes, dtypes and devices from
the tensors' metadata, and the values the kernel indexes with (each context within its block table, each
block id read within the cache) from a :class:`DecodeBounds`. The attention backend computes those from the
step's Python lists (:meth:`DecodeBounds.from_lists`, no device read); a caller that holds only tensors
gets them read from the device (:meth:`DecodeBounds.from_tensors`, one synchronisation).

The kernel is Triton's ``@triton.jit``; on a machine without a GPU it runs in Triton's interpreter when the
process starts with ``TRITON_INTERPRET=1`` (Triton reads it when the kernel is defined, at this module's
import), which is how ``tests/models/test_triton_decode.py`` checks it on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncinfer.errors import InvalidParameterError

__all__ = ["DecodeBounds", "check_decode_inputs", "launch_paged_decode", "paged_decode_attention"]

#: The cache dtypes the kernel reads (queries and caches alike; the softmax is float32 in every case).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class DecodeBounds:
    """What the kernel will index with, as plain ints: the smallest and largest block id that the
    decodes read (their block tables' first ``ceil(context_len / block_size)`` entries) and the shortest
    and longest context. A batch with no decodes has none (``min_block > max_block``)."""

    min_block: int
    max_block: int
    min_context: int
    max_context: int

    @classmethod
    def from_lists(cls, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
                   block_size: int) -> DecodeBounds:
        """From the step's Python lists (no tensor, no device read). A table shorter than its context
        needs is reported by the check (its read part is then taken as the whole table)."""
        read = [table[: -(-ctx // block_size)] for table, ctx in zip(block_tables, context_lens)]
        ids = [min(part) for part in read if part], [max(part) for part in read if part]
        return cls(min(ids[0], default=0), max(ids[1], default=-1), min(context_lens, default=1),
                   max(context_lens, default=0))

    @classmethod
    def from_tensors(cls, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodeBounds:
        """From the tensors the kernel takes: one small reduction and one copy to the host (a synchronisation
        on a GPU). ``block_tables``: ``[S, width]``; ``context_lens``: ``[S]``."""
        if context_lens.numel() == 0:
            return cls(0, -1, 1, 0)
        lens = context_lens.to(torch.int64)
        needed = (lens + block_size - 1) // block_size  # [S]
        read = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < needed[:, None]  # [S, width]
        tables = block_tables.to(torch.int64)
        big = torch.iinfo(torch.int64).max
        low, high, shortest, longest, any_read = torch.stack([
            torch.where(read, tables, big).min(), torch.where(read, tables, -big).max(), lens.min(), lens.max(),
            read.any().to(torch.int64),
        ]).tolist()
        return cls(low, high, shortest, longest) if any_read else cls(0, -1, shortest, longest)


def check_decode_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None, bounds: DecodeBounds,
) -> None:
    """Everything :func:`paged_decode_attention` needs to hold before it launches.

    Raises:
        InvalidParameterError: naming the first argument out of its range (see :func:`paged_decode_attention`).
    """
    if q.dim() != 3:
        raise InvalidParameterError("q", tuple(q.shape), "a [num_seqs, num_heads, head_dim] tensor")
    if k_cache.dim() != 4:
        raise InvalidParameterError("k_cache", tuple(k_cache.shape),
                                    "a [num_blocks, block_size, num_kv_heads, head_dim] tensor")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise InvalidParameterError("v_cache", tuple(v_cache.shape), f"k_cache's shape {tuple(k_cache.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if q.dtype not in DTYPES:
        raise InvalidParameterError("q.dtype", q.dtype, f"one of {[str(t) for t in DTYPES]}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != q.dtype:
            raise InvalidParameterError(f"{name}.dtype", cache.dtype, f"q's dtype {q.dtype}")
    if cache_dim != head_dim:
        raise InvalidParameterError("q.shape[2]", head_dim, f"the cache's head_dim {cache_dim}")
    if kv_heads < 1 or num_heads % kv_heads:
        raise InvalidParameterError("q.shape[1]", num_heads, f"a multiple of the cache's {kv_heads} KV heads")
    if num_blocks < 1 or block_size < 1 or head_dim < 1:
        raise InvalidParameterError("k_cache", tuple(k_cache.shape), "no empty dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype not in _INDEX_DTYPES:
        raise InvalidParameterError("block_tables", (tuple(block_tables.shape), block_tables.dtype),
                                    f"an int32 or int64 [num_seqs={num_seqs}, width] tensor")
    if context_lens.dim() != 1 or context_lens.shape[0] != num_seqs or context_lens.dtype not in _INDEX_DTYPES:
        raise InvalidParameterError("context_lens", (tuple(context_lens.shape), context_lens.dtype),
                                    f"an int32 or int64 [num_seqs={num_seqs}] tensor")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                         ("context_lens", context_lens)):
        if tensor.device != q.device:
            raise InvalidParameterError(f"{name}.device", tensor.device, f"q's device {q.device}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise InvalidParameterError("scale", scale, "a finite float > 0")
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise InvalidParameterError("window", window, "None or an int >= 1")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise InvalidParameterError("softcap", softcap, "None or a finite float > 0")
    if num_seqs == 0:
        return
    span = block_tables.shape[1] * block_size
    if bounds.min_context < 1 or bounds.max_context > span:
        raise InvalidParameterError("context_lens", (bounds.min_context, bounds.max_context),
                                    f"1..{span} (block_tables' {block_tables.shape[1]} blocks of {block_size})")
    if bounds.min_block > bounds.max_block:
        return
    if bounds.min_block < 0 or bounds.max_block >= num_blocks:
        raise InvalidParameterError("block_tables", (bounds.min_block, bounds.max_block),
                                    f"block ids 0..{num_blocks - 1} (the cache's {num_blocks} blocks)")


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, window: int | None = None, softcap: float | None = None,
    bounds: DecodeBounds | None = None,
) -> torch.Tensor:
    """Attend each sequence's one query over its context, read from the paged cache in place; returns ``[S, H, D]``.

    ``q``: ``[S, H, D]`` (the query of the token at position ``context_lens[s] - 1``, its K/V already in
    the cache); ``k_cache``, ``v_cache``: ``[num_blocks, block_size, KVH, D]``, ``q``'s dtype (float32,
    bfloat16 or float16), ``H`` a multiple of ``KVH``; ``block_tables``: ``[S, width]`` int32/int64, row ``s``
    the blocks of sequence ``s`` in order (entries past its context are never read); ``context_lens``:
    ``[S]`` int32/int64, each ``1 .. width * block_size``; ``scale``: the softmax scale; ``window``: keys
    ``context_len - window .. context_len - 1`` only; ``softcap``: scores capped as ``softcap *
    tanh(scores / softcap)``; ``bounds``: the tables' read ids and the context lengths as plain ints
    (:meth:`DecodeBounds.from_lists`), else read from the tensors (one synchronisation on a GPU).

    Raises:
        InvalidParameterError: an argument out of its range (:func:`check_decode_inputs`), before anything runs.
    """
    if bounds is None and q.dim() == 3 and k_cache.dim() == 4 and block_tables.dim() == 2 and context_lens.dim() == 1 \
            and block_tables.shape[0] == context_lens.shape[0] and block_tables.device == context_lens.device:
        bounds = DecodeBounds.from_tensors(block_tables, context_lens, k_cache.shape[1])
    check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap,
                        bounds or DecodeBounds(0, -1, 1, 0))
    return launch_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap)


def launch_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
) -> torch.Tensor:
    """:func:`paged_decode_attention` without its checks: for a caller that has just passed the same arguments
    through :func:`check_decode_inputs` (the attention backend, once per layer). Returns ``[S, H, D]``."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [S, H, D]
    if num_seqs == 0:
        return out
    group = num_heads // kv_heads
    _paged_decode_kernel[(num_seqs, kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens,
        float(scale), float(softcap or 1.0), int(window or 0),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_tables.stride(),
        context_lens.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=triton.next_power_of_2(block_size),
        USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None,
    )
    return out


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
    scale, softcap, window,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_os, stride_oh, stride_od,
    stride_ts, stride_tb,
    stride_l,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    """One program: sequence ``program_id(0)``, KV head ``program_id(1)`` and its GROUP query heads.

    The context is walked one KV block at a time (BLOCK_N >= BLOCK_SIZE lanes, the extra ones masked),
    from the block holding the window's first key to the block holding the last; each block's keys and
    values are loaded from where the block table says, and folded into a running max, sum and output
    (the online softmax), all in float32.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)  # [BG] the query heads of this KV head
    d = tl.arange(0, BLOCK_D)  # [BD]
    n = tl.arange(0, BLOCK_N)  # [BN] offsets within a block
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    n_ok = n < BLOCK_SIZE
    heads = kv_head * GROUP + g  # [BG]
    q_mask = g_ok[:, None] & d_ok[None, :]  # [BG, BD]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(tl.float32)  # [BG, BD]
    ctx = tl.load(lens_ptr + seq * stride_l).to(tl.int64)
    first = ctx * 0  # the first key this query sees
    if USE_WINDOW:
        first = tl.maximum(ctx - window, 0)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # running max (finite: a masked score is -inf)
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running output
    for b in range(first // BLOCK_SIZE, (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_ts + b * stride_tb).to(tl.int64)
        pos = b * BLOCK_SIZE + n  # [BN] the keys' positions
        seen = n_ok & (pos < ctx) & (pos >= first)  # [BN]
        kv_mask = seen[:, None] & d_ok[None, :]  # [BN, BD]
        k = tl.load(k_ptr + block * stride_kb + n[:, None] * stride_kt + kv_head * stride_kh + d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0).to(tl.float32)  # [BN, BD]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BG, BN]
        if USE_SOFTCAP:
            # softcap * tanh(s / softcap), tanh written with exp: 1 - 2 / (e^2x + 1) saturates to +-1.
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BG]
        alpha = tl.exp(m_i - m_new)  # [BG]
        p = tl.exp(s - m_new[:, None])  # [BG, BN]
        v = tl.load(v_ptr + block * stride_vb + n[:, None] * stride_vt + kv_head * stride_vh + d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0).to(tl.float32)  # [BN, BD]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [BG, BD]
        m_i = m_new
    out = acc / l_i[:, None]  # [BG, BD]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)
