"""The kernels' single operations: the block-format GEMM, RMS norm, paged decode attention, argmax and the
embedding's rows, each checking its inputs before the compiled call."""

from __future__ import annotations

import ctypes
import math
from typing import NamedTuple

import torch

from asyncinfer.kernels._build import BF16_MIN_ROWS
from asyncinfer.kernels._build import lib as _need
from asyncinfer.kernels._checks import (
    MAX_BYTES,
    bounded,
    contiguous,
    empty,
    memory,
    out_of_memory,
    real,
    size,
    tensor,
)
from asyncinfer.kernels._checks import softcap as _softcap
from asyncinfer.kernels.formats import (
    BLOCK_FORMATS,
    LANE_ROWS,
    LANES16,
    LANES_FORMATS,
    LAYOUTS,
    BlockTable,
    activation_dtype_flag,
    activation_dtype_name,
    format_name,
    int8_kernel_flag,
)
from asyncinfer.kernels.formats import bytes_per_block as _bytes_per_block
from asyncinfer.kernels.formats import check_blocks as _check_blocks

_MAX_FLOATS = MAX_BYTES // 4
#: The bytes of bfloat16 weight rows a bfloat16 step rebuilds at a time (:func:`gemm`): the call's one scratch,
#: reused slice after slice (never a copy of the whole matrix). 8 MiB measured fastest on an AMX Xeon: smaller
#: slices make more, less efficient products; from about 32 MiB the allocator maps fresh pages every call.
_BF16_SLICE_BYTES = 8 << 20
#: embed_t's format codes besides the block formats' (asyncinfer_kernels.h): the flag of a Q4_1 / Q8_0 table in
#: the kernels' layout, and a float32 table.
_EMBED_PACKED = 0x100
_EMBED_F32 = 0x200


class _Embed(ctypes.Structure):
    """``embed_t`` in asyncinfer_kernels.h: an embedding table the kernels read rows of."""

    _fields_ = [("rows", ctypes.c_void_p), ("vocab", ctypes.c_int64), ("ld", ctypes.c_int64), ("fmt", ctypes.c_int32),
                ("scale", ctypes.c_float)]


class EmbedTable(NamedTuple):
    """An embedding table as the kernels read its rows, checked (:func:`embed_table`): its ``embed_t``, that
    struct's address (what a call passes), the tensor whose memory it points into (held here, so the memory
    outlives the pointer), and its rows and columns."""

    struct: _Embed
    address: int
    memory: torch.Tensor
    vocab: int
    hidden: int


def embed_scale(value: object, name: str = "embed_scale") -> float:
    """An embedding scale (each row's values are multiplied by it; 1: as stored): TypeError for anything but a
    real number, ValueError unless finite and within float32 (naming ``name``)."""
    scale = real(name, value)
    if not math.isfinite(scale) or abs(scale) > 3.4e38:
        raise ValueError(f"{name} must be a finite float32, got {scale!r}")
    return scale


def embed_table(table: object, hidden: int | None, scale: float = 1.0, name: str = "embed") -> EmbedTable | None:
    """``table`` as the kernels read its rows (``asyncinfer_embed_rows``), ``hidden`` its width where the caller
    needs one: a :class:`~asyncinfer.kernels.BlockTable` in any block format (ggml's order, or the kernels' layout
    for Q4_1 / Q8_0), or a float32 CPU tensor [vocab, hidden] whose rows hold their values one after another;
    None for any other floating-point table [vocab, hidden] (float16, a column-strided view...), whose rows the
    caller gathers itself. ``scale``: :func:`embed_scale`'s, already checked.

    Raises TypeError naming ``name`` for a table that is neither, a width other than ``hidden``, blocks that are
    not contiguous uint8 [vocab, a whole number of blocks] on the CPU; ValueError for an unknown format or a table
    whose storage does not hold its rows.
    """
    if isinstance(table, BlockTable):
        fmt, blocks = table.fmt, table.blocks  # read once: the table's attributes as they are now
        fmt = format_name(fmt, f"{name}'s format")
        size_ = _bytes_per_block(fmt, f"{name}'s format")
        tensor(f"{name}.blocks", blocks, torch.uint8, f"of {fmt} blocks")
        if blocks.dim() != 2 or blocks.shape[1] % size_ or not blocks.is_contiguous():
            raise TypeError(f"{name}.blocks: a {fmt} table is contiguous uint8 [vocab, a multiple of {size_} bytes], "
                            f"got {tuple(blocks.shape)}{'' if blocks.is_contiguous() else ' (not contiguous)'}")
        cols = blocks.shape[1] // size_ * BLOCK_FORMATS[fmt][0]
        if cols < 1 or (hidden is not None and cols != hidden):
            raise TypeError(f"{name} must be a table [vocab, {hidden if hidden is not None else 'hidden >= 1'}], got "
                            f"a {fmt} BlockTable of {blocks.shape[0]} rows of {cols} values")
        layout = LAYOUTS[fmt]
        code = layout.code | (_EMBED_PACKED if table.regrouped and layout.regrouped else 0)
        struct = _Embed(blocks.data_ptr(), blocks.shape[0], blocks.shape[1], code, scale)
        return EmbedTable(struct, ctypes.addressof(struct), blocks, blocks.shape[0], cols)
    tensor(name, table, allowed="or a BlockTable")
    assert isinstance(table, torch.Tensor)
    if table.dim() != 2 or table.shape[1] < 1 or (hidden is not None and table.shape[1] != hidden) or (
            not table.is_floating_point()):
        raise TypeError(f"{name} must be a CPU table [vocab, {hidden if hidden is not None else 'hidden >= 1'}] or a "
                        f"BlockTable, got {table.dtype} {tuple(table.shape)}")
    vocab, cols = table.shape
    if table.dtype != torch.float32 or (cols > 1 and table.stride(1) != 1) or (vocab > 1 and table.stride(0) < cols):
        return None  # rows the kernels do not read as float32 values one after another
    struct = _Embed(table.data_ptr(), vocab, table.stride(0) * 4, _EMBED_F32, scale)
    return EmbedTable(struct, ctypes.addressof(struct), table, vocab, cols)


def embed_rows(table: torch.Tensor | BlockTable, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """float32 [n, hidden]: the rows ``ids`` (int64 [n]) of ``table``, dequantized by the kernels as the first step
    of :class:`~asyncinfer.kernels.DecodeStack` does (``asyncinfer_embed_rows``), each value times ``scale``
    (1: the stored values). ``table``: a :class:`~asyncinfer.kernels.BlockTable` in any block format, whose rows
    are bit for bit :func:`~asyncinfer.kernels.dequantize`'s, or a float32 [vocab, hidden] tensor with rows of
    contiguous values.

    Raises TypeError naming the parameter for a table of another kind (see :func:`embed_table`; a float table
    the kernels do not read included) or ids that are not a CPU int64 [n] tensor; ValueError for a scale that is
    not a finite float32 or sizes beyond 2**62 bytes; IndexError for an id outside [0, vocab)."""
    lib = _need()
    scale = embed_scale(scale, "scale")
    checked = embed_table(table, None, scale, "table")
    if checked is None:
        raise TypeError(f"table: embed_rows reads a BlockTable or a float32 [vocab, hidden] tensor whose rows hold "
                        f"contiguous values, got {table.dtype} {tuple(table.shape)} "  # type: ignore[union-attr]
                        f"strides {table.stride()}")  # type: ignore[union-attr]
    tensor("ids", ids, torch.int64)
    if ids.dim() != 1:
        raise TypeError(f"ids must be int64 [n], got {tuple(ids.shape)}")
    if ids.numel() * checked.hidden > _MAX_FLOATS:
        bounded("ids, the table's width (embed_rows' output)", ids.numel(), checked.hidden, 4)
    ids = ids if ids.is_contiguous() else contiguous(ids, "ids")
    out = empty((ids.numel(), checked.hidden), "ids (embed_rows' output)")
    code = lib.asyncinfer_embed_rows(checked.address, ids.data_ptr(), ids.numel(), checked.hidden, out.data_ptr(),
                                     checked.hidden)
    if code == 1:
        raise IndexError(f"ids: a token id is outside the table [0, {checked.vocab})")
    _check(code, "embed_rows")
    return out


def gemm(x: torch.Tensor, packed: torch.Tensor, fmt: str, out_features: int,
         bias: torch.Tensor | None = None, *, activation_dtype: str = "int16",
         int8_kernel: str = "rows", lanes: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for float32 x [M, K] and W [out_features, K] held as ``fmt`` blocks (any of
    :data:`~asyncinfer.kernels.formats.BLOCK_FORMATS`) in the kernels' layout: ``packed = pack(quantize(W,
    fmt), fmt)`` (uint8 [out_features, K / weights per block * bytes per block], K a multiple of the block's
    weights: 32, 256 for the k-quants; for Q4_1 and Q8_0 ggml's own block order, as :func:`quantize` returns
    it, has the same shape but is not this layout; the other formats' layout is ggml's); returns float32
    [M, out_features].

    Activations: ``activation_dtype="int16"`` rounds them per run of 32 to int16 (from :data:`PANEL_MIN_ROWS` rows on
    in the AVX-512 variants' int16 tile; the avx2 and scalar variants take them in float32 there:
    :func:`~asyncinfer.kernels.int16_batched`); ``"int8"`` (llama.cpp's numerics,
    :data:`~asyncinfer.kernels.formats.ACTIVATION_DTYPES`) rounds them per run of 32 to int8 at any number of rows (the
    k-quants per 256 on the AVX-512 builds, as llama.cpp does),
    each row's result independent of the others; ``"bfloat16"``: int16's below :data:`BF16_MIN_ROWS` rows, and
    from it on the weights rebuilt as bfloat16 (the blocks' values, each rounded once to nearest even), a slice of
    rows at a time into one scratch, and multiplied by torch in bfloat16 (x rounded to bfloat16, products summed
    in float32 by oneDNN, each sum rounded once to bfloat16: torch's bfloat16 product), returned as float32
    (+ bias in float32); fast where the CPU has AMX or AVX-512 BF16, emulated and slow elsewhere. With int8,
    ``int8_kernel``
    (:data:`~asyncinfer.kernels.formats.INT8_KERNELS`) picks the GEMM: ``"rows"`` (default; the kernels' decode
    step's below :data:`~asyncinfer.kernels.STEP_TILE_MIN_ROWS` rows, fastest at a few rows) or ``"tile"`` (16 rows
    a register on the AVX-512 builds, the rows elsewhere: about twice as fast from 64 rows, a fifth as fast at one);
    checked, and then ignored, with int16. ``lanes=True``: ``packed`` is Q4_0 or Q4_1 in lanes
    (:func:`~asyncinfer.kernels.formats.pack_lanes` of ggml's blocks; ``fmt`` ``"q4_0"`` / ``"q4_1"`` or its lanes
    name, :data:`~asyncinfer.kernels.formats.LANES_FORMATS`, int8 activations, ``out_features`` a multiple of 16),
    multiplied by its own GEMM (16 weight rows a register: the fastest at 1 to ~32 rows) or, with
    ``int8_kernel="tile"`` from 32 rows on, by the tile reading the lanes' groups (AVX-512 builds;
    elsewhere the lanes' GEMM at every count); the same float32 operations either way, so the same results, each
    row's the same whatever the others. Runs on torch's intra-op thread count.

    Raises RuntimeError where the kernels cannot run; TypeError naming the parameter for a tensor that is
    not on the CPU, of another dtype or kind of shape (x 2-D float32, packed uint8, bias 1-D floating-point);
    ValueError for weights that disagree with ``fmt``, ``out_features`` or x's width, an ``out_features``
    outside [0, 2**62], sizes whose products pass 2**62 bytes, ``activation_dtype`` not one of ``ACTIVATION_DTYPES``
    or ``int8_kernel`` not one of ``INT8_KERNELS``;
    MemoryError when the output or working memory cannot be allocated.
    """
    lib = _need()
    if not isinstance(lanes, bool):
        raise TypeError(f"lanes must be True or False, got {type(lanes).__name__}")
    asked = "lanes=True"
    if isinstance(fmt, str) and str.__str__(fmt) in LANES_FORMATS:  # a lanes name: lanes, whatever ``lanes``
        asked = f"fmt={str.__str__(fmt)!r}"
        fmt, lanes = LANES_FORMATS[str.__str__(fmt)], True
    fmt = format_name(fmt)  # an unknown format named before the activations
    dtype = activation_dtype_name(activation_dtype)
    flag = activation_dtype_flag(dtype)
    tile = int8_kernel_flag(int8_kernel)
    if lanes:
        if fmt not in LANES_FORMATS.values():
            raise ValueError(f"{asked}: only {sorted(LANES_FORMATS.values())} are held in lanes, got fmt={fmt!r}")
        if dtype != "int8":
            raise ValueError(f"{asked}: {fmt} in lanes is multiplied with int8 activations only, got "
                             f"activation_dtype={dtype!r}")
        if out_features % LANE_ROWS:
            raise ValueError(f"{asked}: out_features must be a multiple of {LANE_ROWS}, got {out_features}")
    flag |= (LANES16 if lanes else 0) | (tile if flag else 0)
    tensor("x", x)
    if x.dtype != torch.float32 or x.dim() != 2:
        raise TypeError(f"x: the {fmt} kernel takes 2-D float32 CPU activations [M, K], got {tuple(x.shape)} "
                        f"{x.dtype} on {x.device}")
    out_features = size("out_features", out_features, 0)
    rows, k = x.shape
    _check_blocks(packed, fmt, out_features, k)
    bounded("x [M, K] (working memory)", rows + 8, k, 4)
    bounded("the output [M, out_features]", rows, out_features, 4)
    if bias is not None:
        tensor("bias", bias)
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor [out_features], got {bias.dtype}")
        if bias.dim() != 1:
            raise TypeError(f"bias must be a 1-D tensor [out_features], got shape {tuple(bias.shape)}")
        if bias.numel() != out_features:
            raise ValueError(f"bias has {bias.numel()} values for {out_features} outputs")
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            bias = bias.float().contiguous()
    if x.stride(-1) != 1:
        x = contiguous(x, "x")
    if dtype == "bfloat16" and rows >= BF16_MIN_ROWS:
        return _gemm_bf16(lib, x, packed, fmt, out_features, bias)
    y = empty((rows, out_features), "x, out_features (gemm's output)")
    if rows:
        scratch = empty((lib.asyncinfer_scratch_bytes(rows, k),), "x (gemm's working memory)", torch.uint8)
        lib.asyncinfer_gemm(LAYOUTS[fmt].code | flag, x.data_ptr(), rows, x.stride(0), k, packed.data_ptr(),
                            out_features, None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                            torch.get_num_threads(), scratch.data_ptr())
    return y


def _gemm_bf16(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, fmt: str, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`gemm`'s bfloat16 step (its inputs checked): the weights rebuilt as bfloat16 a slice of rows at a time
    (``asyncinfer_dequantize_bf16``) into one scratch of at most :data:`_BF16_SLICE_BYTES`, each slice's product
    with x by torch in bfloat16 (oneDNN: AMX / AVX-512 BF16 where the CPU has them)."""
    rows, k = x.shape
    yt = empty((n, rows), "x, out_features (gemm's output)")  # the output transposed: each slice a run of its rows
    if k == 0:
        yt.zero_()
    else:
        per = max(1, min(n, _BF16_SLICE_BYTES // (2 * k)))
        w = empty((per, k), "packed (gemm's bfloat16 weight rows)", torch.bfloat16)
        xt = x.to(torch.bfloat16).t()  # [K, M]
        code, row_bytes, base, threads = LAYOUTS[fmt].code, packed.shape[1], packed.data_ptr(), torch.get_num_threads()
        for n0 in range(0, n, per):
            rows_now = min(per, n - n0)
            _check(lib.asyncinfer_dequantize_bf16(code, base + n0 * row_bytes, rows_now, k, w.data_ptr(), k, threads),
                   "gemm")
            yt[n0:n0 + rows_now] = torch.mm(w[:rows_now], xt)
    y = contiguous(yt.t(), "x, out_features (gemm's output)")
    if bias is not None:
        y += bias
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of float32 x [..., hidden] scaled by ``weight``, the same shape back: the float32 steps
    of :func:`asyncinfer.models.layers.rms_norm`, summed in another order (equal within float32 rounding).

    Raises TypeError naming the parameter for tensors not on the CPU, of another dtype or of shapes that
    disagree (x [..., hidden], weight [hidden]) and an ``eps`` that is not a real number; ValueError for a
    hidden size of 0 or more than 2**62 bytes of x."""
    lib = _need()
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.is_cpu and weight.is_cpu
            and not (x.is_nested or weight.is_nested) and x.dtype == weight.dtype == torch.float32 and x.layout == weight.layout == torch.strided
            and x.dim() >= 1 and weight.shape == x.shape[-1:]):  # one test on the hot path; the details below
        tensor("x", x)
        tensor("weight", weight)
        raise TypeError(f"x, weight: rms_norm takes float32 x [..., hidden] and weight [hidden], got {x.dtype} "
                        f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    memory("x", x)
    memory("weight", weight)
    shape = x.shape
    hidden = shape[-1]
    if hidden < 1:
        raise ValueError(f"x: rms_norm needs a hidden size (x's last dimension) of at least 1, got {tuple(shape)}")
    if type(eps) is not float:
        eps = real("eps", eps)
    rows = x.numel() // hidden
    if rows * hidden > _MAX_FLOATS:
        bounded("x", rows, hidden, 4)
    if not weight.is_contiguous():
        weight = contiguous(weight, "weight")
    if x.stride(-1) != 1 or x.dim() != 2:
        x = contiguous(x.reshape(-1, hidden), "x")
    try:
        y = torch.empty(rows, hidden, dtype=torch.float32)
    except RuntimeError as exc:
        raise out_of_memory(exc, "x (rms_norm's output)") from exc
    lib.asyncinfer_rms_norm(x.data_ptr(), rows, x.stride(0), hidden, weight.data_ptr(), eps, y.data_ptr(),
                             torch.get_num_threads())
    return y if y.shape == shape else y.view(shape)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, *, softcap: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context, read from the cache in place.

    q: float32 [S, H, D]; caches: float32 [blocks, block_size, KVH, D] (this step's K/V written);
    block_tables: int64 [S, >= ceil(context / block_size)]; context_lens: int64 [S]. Returns [S, H, D].
    ``softcap``: None, or a positive finite cap: each score (scale included) becomes
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2). ``window``: None, or a positive int: a
    context of L keys attends to its last ``min(L, window)`` keys, the query's own included (a sliding layer).
    A ValueError names either outside those ranges.

    Raises TypeError naming the parameter for tensors not on the CPU, of another dtype or kind of shape
    (caches that differ, rows that disagree with q's S); ValueError for a scale that is not a finite float32, a
    head_dim that is not a positive multiple of 8, a head, KV-head or block-size count of 0, heads not a
    multiple of the KV heads, or a table width times block size beyond 2**62; IndexError for a context length below 1 or beyond its
    table, or a block outside the caches.
    """
    lib = _need()
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        tensor(name, t, torch.float32)
    tensor("block_tables", block_tables, torch.int64)
    tensor("context_lens", context_lens, torch.int64)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise TypeError(f"q, k_cache, v_cache: decode_attention takes q [S, H, D] and caches [blocks, block_size, "
                        f"KV heads, D] of one shape, got q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                        f"{tuple(v_cache.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if head_dim < 8 or head_dim % 8:
        raise ValueError(f"q: decode_attention needs head_dim a positive multiple of 8, got {head_dim}")
    size("num_heads (q.shape[1])", num_heads)
    size("KV heads (k_cache.shape[2])", kv_heads)
    if num_heads % kv_heads:
        raise ValueError(f"q: decode_attention needs the heads ({num_heads}) a multiple of the KV heads "
                         f"({kv_heads})")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise TypeError("k_cache, v_cache: decode_attention takes contiguous float32 caches")
    if context_lens.numel() != num_seqs:
        raise TypeError(f"context_lens: decode_attention takes int64 context_lens [S={num_seqs}], got "
                        f"{tuple(context_lens.shape)}")
    scale = real("scale", scale)
    if not abs(scale) < 3.4e38:  # NaN, infinite or past float32: every score, and so every output, NaN
        raise ValueError(f"scale must be a finite float32, got {scale!r}")
    cap = 0.0
    if softcap is not None:
        cap = _softcap("softcap", softcap)
    window_keys = 0 if window is None else size("window", window, 1, 2**62)
    q = contiguous(q, "q")  # a view of q/k/v in the engine's layers
    context_lens = contiguous(context_lens, "context_lens")
    tables = block_tables if block_tables.is_contiguous() else contiguous(block_tables, "block_tables")
    _check_paged(lib, tables, context_lens, None, k_cache)
    out = torch.empty_like(q)
    lib.asyncinfer_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                     tables.shape[1], context_lens.data_ptr(), num_seqs, num_heads, kv_heads,
                                     head_dim, block_size, scale, cap, window_keys, out.data_ptr(),
                                     torch.get_num_threads())
    return out



def check_cache_size(name: str, k_cache: torch.Tensor) -> None:
    """ValueError naming ``name`` unless a [blocks, block_size, ...] cache holds at least one block of at least
    one slot (the kernels divide by the block size and address blocks x block_size slots)."""
    if k_cache.shape[0] < 1 or k_cache.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one block of at least one slot, got {tuple(k_cache.shape)}")


def check_width(width: int, block_size: int) -> None:
    """ValueError unless a table width times the block size (the longest context) stays within 2**62."""
    if width * block_size > MAX_BYTES:
        raise ValueError(f"block_tables: a width of {width} blocks of {block_size} slots is beyond 2**62 positions")


def longest(context_lens: torch.Tensor) -> int:
    """The largest of CPU int64 ``context_lens`` (not empty): through a list for the few of a decode step,
    which costs a fifth of a torch reduction."""
    return max(context_lens.view(-1).tolist()) if context_lens.numel() <= 256 else int(context_lens.max())


def check_context(max_context: int, width: int, block_size: int) -> None:
    """IndexError unless the longest context fits a table ``width`` blocks wide (checked before the kernels'
    own check, whose int64 rounding-up would wrap for a length near 2**63)."""
    if max_context > width * block_size:
        raise IndexError(f"context_lens: a context length ({max_context}) is beyond its block table ({width} "
                         f"blocks of {block_size})")


def _check_paged(lib: ctypes.CDLL, tables: torch.Tensor, context_lens: torch.Tensor, slots: torch.Tensor | None,
                 k_cache: torch.Tensor) -> None:
    """Raise IndexError unless every context fits its block table and every slot and block it reads is
    in the caches (the kernels trust them); int64 contiguous inputs, one row / length / slot a sequence."""
    num_seqs = context_lens.numel()
    for name, t, n in (("context_lens", context_lens, num_seqs), ("slots", slots, num_seqs),
                       ("block_tables", tables, None)):
        if t is not None and (not isinstance(t, torch.Tensor) or not t.is_cpu or t.dtype != torch.int64
                              or not t.is_contiguous() or (n is not None and (t.dim() != 1 or t.numel() != n))):
            tensor(name, t, torch.int64)
            raise TypeError(f"{name} must be contiguous int64 [sequences] with one entry a sequence, got {t.dtype} "
                            f"{tuple(t.shape)}")
        if t is not None:
            memory(name, t)
    if tables.dim() != 2 or tables.shape[0] != num_seqs:
        raise TypeError(f"block_tables must be int64 [sequences={num_seqs}, blocks], got {tuple(tables.shape)}")
    check_cache_size("k_cache", k_cache)
    check_width(tables.shape[1], k_cache.shape[1])
    if num_seqs:
        check_context(longest(context_lens), tables.shape[1], k_cache.shape[1])
    _raise_paged(lib.asyncinfer_check_paged(tables.data_ptr(), tables.shape[1], context_lens.data_ptr(),
                                            None if slots is None else slots.data_ptr(), num_seqs, k_cache.shape[1],
                                            k_cache.shape[0]), tables.shape[1], k_cache)


def _raise_paged(code: int, table_width: int, k_cache: torch.Tensor) -> None:
    """The IndexError of ``asyncinfer_check_paged``'s codes (3, 4); nothing for any other."""
    if code == 3:
        raise IndexError(f"context_lens: a context length is below 1 or beyond its block table ({table_width} "
                         f"blocks)")
    if code == 4:
        raise IndexError(f"slots, block_tables: a cache slot or block is outside the caches ({k_cache.shape[0]} blocks of "
                         f"{k_cache.shape[1]})")


def _check_timing(timing: torch.Tensor | None, parts: int, owner: str) -> None:
    if timing is not None and (not isinstance(timing, torch.Tensor) or not timing.is_cpu
                               or timing.dtype != torch.float64 or timing.numel() < parts or not timing.is_contiguous()):
        raise TypeError(f"{owner}.timing must be None or contiguous float64 [{parts}] (see time_parts)")


def _check(code: int, what: str) -> None:
    if code == -1:
        raise MemoryError(f"{what}: the kernels could not allocate their working memory")
    if code:
        raise RuntimeError(f"{what} failed with code {code}")


def argmax_takes(x: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes ``x``: a CPU float32 [rows, n > 0] tensor whose rows follow each
    other (values contiguous, rows apart by at least n), not a lazily negated view (``is_neg()``)."""
    return (isinstance(x, torch.Tensor) and not x.is_nested and x.dtype == torch.float32 and x.dim() == 2 and x.is_cpu
            and x.layout == torch.strided and x.shape[1] > 0 and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1])
            and (x.shape[1] == 1 or x.stride(1) == 1) and not x.is_neg())


def argmax(x: torch.Tensor) -> list[int]:
    """Each row's index of its largest value of float32 x [rows, n] (rows may be strided; values
    contiguous), the first among equals and the first NaN if any, as ``torch.argmax`` picks them:
    one vectorised pass, for greedy sampling."""
    lib = _need()
    if not argmax_takes(x):
        tensor("x", x, torch.float32)
        raise TypeError(f"x: argmax takes a CPU float32 [rows, n > 0] tensor with contiguous rows, got {x.dtype} "
                        f"{tuple(x.shape)} on {x.device}")
    memory("x", x)
    out = (ctypes.c_int64 * x.shape[0])()
    lib.asyncinfer_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out)
    return list(out)
