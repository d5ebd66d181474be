"""The kernels' single operations: the block-format GEMM, RMS norm, paged decode attention and argmax,
each checking its inputs before the compiled call."""

from __future__ import annotations

import ctypes

import torch

from asyncinfer.kernels._build import lib as _need
from asyncinfer.kernels.formats import bytes_per_block as _bytes_per_block
from asyncinfer.kernels.formats import check_blocks as _check_blocks


def gemm(x: torch.Tensor, packed: torch.Tensor, fmt: str, out_features: int,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for float32 x [M, K] and W [out_features, K] held as ``fmt`` blocks in the
    kernels' layout: ``packed = pack(quantize(W, fmt), fmt)`` (uint8 [out_features, K / 32 * bytes per
    block]; ggml's own block order, as :func:`quantize` returns it, has the same shape but is not this
    layout); returns float32 [M, out_features].

    Activations: rounded per block of 32 to int16 below :data:`PANEL_MIN_ROWS` rows, float32 from it on.
    Runs on torch's intra-op thread count. Raises RuntimeError where the kernels cannot run.
    """
    lib = _need()
    _bytes_per_block(fmt)  # an unknown format named before the activations
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise TypeError(f"the {fmt} kernel takes 2-D float32 CPU activations, got {tuple(x.shape)} {x.dtype} on "
                        f"{x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    _check_blocks(packed, fmt, out_features, k)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    if bias is not None and bias.numel() != out_features:
        raise ValueError(f"bias has {bias.numel()} values for {out_features} outputs")
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows:
        scratch = torch.empty(lib.asyncinfer_scratch_bytes(rows, k), dtype=torch.uint8)
        fn = getattr(lib, f"asyncinfer_gemm_{fmt}")
        fn(x.data_ptr(), rows, x.stride(0), k, packed.data_ptr(), out_features,
           None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads(),
           scratch.data_ptr())
    return y



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of float32 x [..., hidden] scaled by ``weight``, the same shape back: the float32 steps
    of :func:`asyncinfer.models.layers.rms_norm`, summed in another order (equal within float32 rounding)."""
    lib = _need()
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != x.shape[-1:]:
        raise TypeError(f"rms_norm takes float32 x [..., hidden] and weight [hidden], got {x.dtype} "
                        f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    weight = weight.contiguous()
    shape = x.shape
    if x.stride(-1) != 1 or x.dim() != 2:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    rows, hidden = x.shape
    y = torch.empty(rows, hidden, dtype=torch.float32)
    lib.asyncinfer_rms_norm(x.data_ptr(), rows, x.stride(0), hidden, weight.data_ptr(), eps, y.data_ptr(),
                             torch.get_num_threads())
    return y if y.shape == shape else y.view(shape)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context, read from the cache in place.

    q: float32 [S, H, D]; caches: float32 [blocks, block_size, KVH, D] (this step's K/V written);
    block_tables: int64 [S, >= ceil(context / block_size)]; context_lens: int64 [S]. Returns [S, H, D].
    Raises IndexError for a context length below 1 or beyond its table, or a block outside the caches.
    """
    lib = _need()
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if head_dim % 8 or num_heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"decode_attention needs head_dim a multiple of 8, heads a multiple of KV heads and "
                         f"matching caches: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not all(t.dtype == torch.float32 for t in (q, k_cache, v_cache)) or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise TypeError("decode_attention takes float32 q and contiguous float32 caches")
    q = q.contiguous()  # a view of q/k/v in the engine's layers
    if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64 or context_lens.numel() != num_seqs:
        raise TypeError("decode_attention takes int64 block_tables [S, n] and context_lens [S]")
    context_lens = context_lens.contiguous()
    tables = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
    _check_paged(lib, tables, context_lens, None, k_cache)
    out = torch.empty_like(q)
    lib.asyncinfer_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                     tables.shape[1], context_lens.data_ptr(), num_seqs, num_heads, kv_heads,
                                     head_dim, block_size, scale, out.data_ptr(), torch.get_num_threads())
    return out



def _check_paged(lib: ctypes.CDLL, tables: torch.Tensor, context_lens: torch.Tensor, slots: torch.Tensor | None,
                 k_cache: torch.Tensor) -> None:
    """Raise IndexError unless every context fits its block table and every slot and block it reads is
    in the caches (the kernels trust them); int64 contiguous inputs, one row / length / slot a sequence."""
    num_seqs = context_lens.numel()
    for name, t, n in (("context_lens", context_lens, num_seqs), ("slots", slots, num_seqs),
                       ("block_tables", tables, None)):
        if t is not None and (t.dtype != torch.int64 or not t.is_contiguous() or (n is not None and t.numel() != n)):
            raise TypeError(f"{name} must be contiguous int64 with one entry a sequence, got {t.dtype} "
                            f"{tuple(t.shape)}")
    if tables.dim() != 2 or tables.shape[0] != num_seqs:
        raise TypeError(f"block_tables must be int64 [sequences={num_seqs}, blocks], got {tuple(tables.shape)}")
    _raise_paged(lib.asyncinfer_check_paged(tables.data_ptr(), tables.shape[1], context_lens.data_ptr(),
                                            None if slots is None else slots.data_ptr(), num_seqs, k_cache.shape[1],
                                            k_cache.shape[0]), tables.shape[1], k_cache)


def _raise_paged(code: int, table_width: int, k_cache: torch.Tensor) -> None:
    """The IndexError of ``asyncinfer_check_paged``'s codes (3, 4); nothing for any other."""
    if code == 3:
        raise IndexError(f"a context length is below 1 or beyond its block table ({table_width} blocks)")
    if code == 4:
        raise IndexError(f"a cache slot or block is outside the caches ({k_cache.shape[0]} blocks of "
                         f"{k_cache.shape[1]})")


def _check_timing(timing: torch.Tensor | None, parts: int, owner: str) -> None:
    if timing is not None and (timing.dtype != torch.float64 or timing.numel() < parts or not timing.is_contiguous()):
        raise TypeError(f"{owner}.timing must be None or contiguous float64 [{parts}] (see time_parts)")


def _check(code: int, what: str) -> None:
    if code == -1:
        raise MemoryError(f"{what}: the kernels could not allocate their working memory")
    if code:
        raise RuntimeError(f"{what} failed with code {code}")


def argmax_takes(x: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes ``x``: a CPU float32 [rows, n > 0] tensor whose rows follow each
    other (values contiguous, rows apart by at least n)."""
    return (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] > 0
            and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1]) and (x.shape[1] == 1 or x.stride(1) == 1))


def argmax(x: torch.Tensor) -> list[int]:
    """Each row's index of its largest value of float32 x [rows, n] (rows may be strided; values
    contiguous), the first among equals and the first NaN if any, as ``torch.argmax`` picks them:
    one vectorised pass, for greedy sampling."""
    lib = _need()
    if not argmax_takes(x):
        raise TypeError(f"argmax takes a CPU float32 [rows, n > 0] tensor with contiguous rows, got {x.dtype} "
                        f"{tuple(x.shape)} on {x.device}")
    out = (ctypes.c_int64 * x.shape[0])()
    lib.asyncinfer_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out)
    return list(out)
