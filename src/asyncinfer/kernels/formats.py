"""ggml's block formats as the kernels hold them: their sizes (:data:`LAYOUTS`, the one place they are
written), the kernels' layout (:func:`pack` / :func:`unpack`), and the codec (:func:`quantize`,
:func:`dequantize`). Pure torch; no compiled code.

Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and the k-quants Q4_K, Q5_K, Q6_K
(super-blocks of 256). :func:`dequantize` rebuilds every format bit for bit as ggml does. :func:`quantize`
builds the blocks from float32 weights; for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, on weights that were
dequantised from blocks of the same type as llama.cpp's reference quantisers write them (a GGUF file's),
it returns those blocks again, so the kernel multiplies by exactly the float32 model's weights (the loader
checks it per layer). The k-quants' quantizer is a plain one (see :func:`quantize`); a file's k-quant blocks
are used as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from asyncinfer.kernels._checks import allocating as _allocating
from asyncinfer.kernels._checks import tensor as _tensor
from asyncinfer.kernels.pages import in_huge_pages, weight_buffer


class BlockLayout(NamedTuple):
    """One of ggml's block formats: its sizes, and its code in the kernels (``csrc/asyncinfer_kernels.h``'s
    ``ASYNCINFER_FMT_*``, ``layer_t``'s parts). The bytes of a block, in ggml's order:

    - Q4_0: float16 scale ``d``, 16 bytes of nibbles; weight ``d * (q - 8)``.
    - Q4_1: ``d``, float16 minimum ``m``, 16 bytes of nibbles; ``d * q + m``.
    - Q5_0: ``d``, ``qh`` (32 high bits, little-endian), 16 bytes of nibbles; ``d * (q - 16)``.
    - Q5_1: ``d``, ``m``, ``qh``, 16 bytes of nibbles; ``d * q + m``.
    - Q8_0: ``d``, 32 int8; ``d * q``.
      (The 32-weight formats' nibbles: element j is byte j's low nibble, element j + 16 its high one; bit j
      of ``qh`` is element j's fifth bit.)
    - Q4_K (super-blocks of 256 weights): ``d``, ``dmin`` (float16), 12 bytes holding eight 6-bit scales
      ``sc`` and eight 6-bit minimums ``mn``, 128 bytes of nibbles; sub-block j of 32 (bytes 32 (j // 2) on,
      low nibbles for even j, high for odd) is ``(d * sc_j) * q - dmin * mn_j``.
    - Q5_K: as Q4_K with 32 bytes ``qh`` between the scales and the nibbles (bit j of ``qh[i]``: the fifth
      bit of sub-block j's element i).
    - Q6_K: 128 bytes of low nibbles ``ql``, 64 bytes of high bit pairs ``qh``, 16 int8 scales (one per 16
      weights), then ``d``; weight ``(d * sc) * (q - 32)`` with 6-bit q.
    """

    weights: int  #: weights per block
    bits: int  #: bits per quant
    has_min: bool  #: whether a block adds an offset: a float16 minimum (Q4_1, Q5_1), minimums times dmin (Q4_K, Q5_K)
    nbytes: int  #: bytes per block
    code: int  #: the kernels' format code (ASYNCINFER_FMT_*)
    ggml_type: int  #: ggml's type number (gguf's GGMLQuantizationType)

    @property
    def head(self) -> int:
        """Q4_0, Q4_1 and Q8_0 (one run of quants after the scales): bytes before the quants."""
        return 2 + 2 * self.has_min

    @property
    def quant_bytes(self) -> int:
        """Q4_0, Q4_1 and Q8_0: bytes of quants per block."""
        return self.weights * self.bits // 8

    @property
    def regrouped(self) -> bool:
        """Whether the kernels' layout (:func:`pack`) regroups the blocks' bytes per row (Q4_1, Q8_0); the
        other formats are multiplied in ggml's own block layout, as a file holds them."""
        return self.code <= 1


#: Every block format the kernels multiply by, and the one place their layout is written.
LAYOUTS = {
    "q4_1": BlockLayout(32, 4, True, 20, 0, 3),
    "q8_0": BlockLayout(32, 8, False, 34, 1, 8),
    "q4_0": BlockLayout(32, 4, False, 18, 2, 2),
    "q5_0": BlockLayout(32, 5, False, 22, 3, 6),
    "q5_1": BlockLayout(32, 5, True, 24, 4, 7),
    "q4_k": BlockLayout(256, 4, True, 144, 5, 12),
    "q5_k": BlockLayout(256, 5, True, 176, 6, 13),
    "q6_k": BlockLayout(256, 6, False, 210, 7, 14),
}
#: Block formats: (weights per block, bytes per block).
BLOCK_FORMATS = {name: (layout.weights, layout.nbytes) for name, layout in LAYOUTS.items()}
#: The formats by ggml's type number (a GGUF tensor's type).
BY_GGML_TYPE = {layout.ggml_type: name for name, layout in LAYOUTS.items()}
#: Every ggml block format asyncinfer reads (the GGUF reader, models/gguf_file.py): the kernels' own.
READ_LAYOUTS = LAYOUTS
#: Weights per activation block: the kernels round activations per run of QK; every format's block is a
#: whole number of them.
QK = 32
#: The k-quants' super-block.
QK_K = 256
assert all(layout.weights % QK == 0 for layout in LAYOUTS.values())
assert sorted(layout.code for layout in LAYOUTS.values()) == list(range(len(LAYOUTS)))


def bytes_per_block(fmt: str, what: str = "fmt") -> int:
    """Bytes per block of ``fmt``: TypeError for a non-string, ValueError for an unknown name (naming ``what``)."""
    if not isinstance(fmt, str):
        raise TypeError(f"{what} must be a block format name, one of {list(BLOCK_FORMATS)}, got "
                        f"{type(fmt).__name__}")
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"{what}: unknown block format {fmt!r}; expected one of {list(BLOCK_FORMATS)}")
    return BLOCK_FORMATS[fmt][1]


def format_name(fmt: object, what: str = "fmt") -> str:
    """``fmt`` as the plain ``str`` it holds, once it names a block format (errors as :func:`bytes_per_block`'s).
    A ``str`` subclass's own ``__hash__``, ``__eq__`` or ``__format__`` could name one format to the checks and
    another to the kernel, which would then read the blocks at another format's size: every entry that hands a
    format to compiled code reads it through this first."""
    if isinstance(fmt, str) and type(fmt) is not str:
        fmt = str.__str__(fmt)
    bytes_per_block(fmt, what)
    return fmt  # type: ignore[return-value]


#: How the block-format GEMMs round the activations, per run of 32: ``"int16"`` (the default: within float32's
#: rounding of the exact product; from :data:`PANEL_MIN_ROWS` rows on float32 in the avx2 and scalar variants,
#: :func:`~asyncinfer.kernels.int16_batched`), ``"int8"``
#: (llama.cpp's numerics: the quants' bytes multiplied as they come, faster, about 1% of a product's size off,
#: at every number of rows, a row's result independent of the other rows of a call (a decode step switches
#: kernels at :data:`~asyncinfer.kernels.STEP_TILE_MIN_ROWS` rows; the AVX-512 builds take the k-quants'
#: activations with a scale per 256 in both, as llama.cpp does); docs/formats.md, "Activations") or
#: ``"bfloat16"`` (int16's below :data:`BF16_MIN_ROWS` rows; from it on the weights rebuilt as bfloat16 per call and
#: multiplied by torch in bfloat16: fast on CPUs with AMX / AVX-512 BF16, slow elsewhere; docs/formats.md,
#: "Batched steps").
ACTIVATION_DTYPES = ("int16", "int8", "bfloat16")
#: csrc/asyncinfer_kernels.h's ASYNCINFER_FMT_ACT8: the flag on a format code that takes int8 activations.
_ACT8 = 0x40
#: Which int8 GEMM :func:`asyncinfer.kernels.gemm` runs (``int8_kernel``): ``"rows"`` (each activation row against
#: each weight row, the kernels' decode step's below STEP_TILE_MIN_ROWS rows; fastest at a few rows) or ``"tile"``
#: (16 activation rows a register, where the build has it (AVX-512; the rows elsewhere): about 2x the rows' speed at
#: 64 rows and more, a fifth of it at one row). Each gives a row the same result whatever the other rows; the two
#: differ from each other in the order of float32 additions.
INT8_KERNELS = ("rows", "tile")
#: csrc/asyncinfer_kernels.h's ASYNCINFER_FMT_TILE8.
_TILE8 = 0x80
#: csrc/asyncinfer_kernels.h's ASYNCINFER_FMT_LANES16: Q4_0 or Q4_1 in lanes (:func:`pack_lanes`), int8 activations.
LANES16 = 0x20


def activation_dtype_name(activation_dtype: object, what: str = "activation_dtype") -> str:
    """``activation_dtype`` as the plain ``str`` it holds, once it is one of :data:`ACTIVATION_DTYPES`; ValueError
    naming ``what`` and the allowed values for anything else."""
    value = str.__str__(activation_dtype) if isinstance(activation_dtype, str) else None  # the plain str it holds
    if value not in ACTIVATION_DTYPES:
        raise ValueError(f"{what} must be one of {list(ACTIVATION_DTYPES)}, got {activation_dtype!r}")
    return value


def activation_dtype_flag(activation_dtype: object, what: str = "activation_dtype") -> int:
    """The flag :data:`ACTIVATION_DTYPES`' ``activation_dtype`` puts on a format code in the kernels: 0 for int16 and
    for bfloat16 (whose steps the kernels take are int16's: below ``BF16_MIN_ROWS`` rows); ValueError naming
    ``what`` and the allowed values for anything else."""
    return _ACT8 if activation_dtype_name(activation_dtype, what) == "int8" else 0


def int8_kernel_flag(int8_kernel: object, what: str = "int8_kernel") -> int:
    """The flag :data:`INT8_KERNELS`' ``int8_kernel`` puts on an int8 format code (0 for the rows); ValueError naming
    ``what`` and the allowed values for anything else."""
    value = str.__str__(int8_kernel) if isinstance(int8_kernel, str) else None
    if value not in INT8_KERNELS:
        raise ValueError(f"{what} must be one of {list(INT8_KERNELS)}, got {int8_kernel!r}")
    return _TILE8 if value == "tile" else 0


def block_weights(fmt: str, what: str = "fmt") -> int:
    """Weights per block of ``fmt`` (32, or 256 for the k-quants); errors as :func:`bytes_per_block`'s."""
    bytes_per_block(fmt, what)
    return BLOCK_FORMATS[fmt][0]


def check_blocks(packed: torch.Tensor, fmt: str, out_features: int, k: int, name: str = "packed") -> None:
    """ValueError (TypeError for another device or dtype) naming ``name`` unless ``packed`` is ``fmt``'s
    blocks of ``out_features`` rows of ``k`` inputs, contiguous uint8 on the CPU."""
    size = bytes_per_block(fmt, "fmt" if name == "packed" else f"{name}'s format")
    per = BLOCK_FORMATS[fmt][0]
    _tensor(name, packed, torch.uint8, f"of {fmt} blocks")
    if (packed.dtype == torch.uint8 and packed.dim() == 2 and packed.shape[0] == out_features and packed.shape[1]
            and packed.shape[1] % size == 0 and packed.shape[1] // size * per != k):
        raise ValueError(f"x has {k} columns, but the {fmt} weights hold {packed.shape[1] // size * per} inputs "
                         f"per row")
    expected = (out_features, k // per * size)
    if k % per or packed.dtype != torch.uint8 or tuple(packed.shape) != expected or not packed.is_contiguous():
        raise ValueError(f"{name}: {fmt} weights for {k} inputs and {out_features} outputs are contiguous uint8 "
                         f"{expected} (the input size a multiple of {per}), got {packed.dtype} {tuple(packed.shape)}"
                         f"{'' if packed.is_contiguous() else ' (not contiguous)'}")


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] -> its float16 bytes [..., 2]."""
    return t.half().view(torch.uint8)


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes ``at``, ``at + 1`` of blocks [..., bytes], as float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d where d is a finite non-zero scale, else 0 (a block of zeros quantizes to zeros)."""
    return torch.where((d != 0) & d.isfinite(), 1.0 / d, torch.zeros_like(d))


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two runs of 4-bit values -> bytes: ``lo`` in the low nibbles, ``hi`` in the high ones."""
    return (lo & 0x0F) | ((hi & 0x0F) << 4)


_BIT = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)


def _fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's qh: [..., 32] quants -> [..., 4] bytes, bit j of the 32 the fifth bit of element j."""
    bits = ((q.to(torch.int32) >> 4) & 1).reshape(*q.shape[:-1], 4, 8)
    return (bits * _BIT).sum(-1).to(torch.uint8)


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: eight 6-bit scales and minimums [..., 8] -> their 12 bytes (ggml's packing)."""
    sc, mn = sc.to(torch.int32), mn.to(torch.int32)
    low = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    high = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return torch.cat((low, mid, high), dim=-1).to(torch.uint8)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 bytes [..., 12] -> the eight 6-bit scales and minimums, each [..., 8] int32."""
    s = s.to(torch.int32)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((a & 63, (c & 0x0F) | ((a >> 6) << 4)), dim=-1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return sc, mn


def _quantize_k(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """Q4_K / Q5_K's quantizer on super-blocks [N, B, 256]: per sub-block of 32, its minimum (at most 0)
    ``lo`` and span ``(max - lo) / levels``; the super-block's ``d`` and ``dmin`` the largest span and
    ``-lo`` over 63; the 6-bit ``sc`` rounded up (the span fits) and ``mn`` to nearest; then each
    ``q = round((w + dmin * mn) / (d * sc))`` in [0, levels], against the stored float16 values.
    Returns d16, dmin16 [N, B, 1], sc, mn [N, B, 8] and q [N, B, 8, 32] (int32)."""
    sub = w.reshape(*w.shape[:-1], 8, 32)
    lo = sub.amin(dim=-1).clamp(max=0.0)  # [N, B, 8]
    span = (sub.amax(dim=-1) - lo) / levels
    d16 = (span.amax(dim=-1, keepdim=True) / 63).half()
    dmin16 = ((-lo).amax(dim=-1, keepdim=True) / 63).half()
    d, dmin = d16.float(), dmin16.float()
    sc = (span * _inverse(d)).ceil().clamp(0, 63)
    mn = (-lo * _inverse(dmin)).round().clamp(0, 63)
    step, offset = d * sc, dmin * mn  # exact in float32
    q = ((sub + offset[..., None]) * _inverse(step)[..., None]).round().clamp(0, levels).to(torch.int32)
    return d16, dmin16, sc, mn, q


#: float16's largest finite value.
F16_MAX = 65504.0
#: The magnitude from which float16 rounds to an infinity (to nearest, ties to even): the weights :func:`quantize` and
#: the float16 format take are below it (a weight in (65504, 65520) is stored as 65504, its nearest float16).
F16_ROUNDS_TO_INF = 65520.0


@_allocating("weight")
def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 weights [N, K] (K a multiple of the format's block: 32, or 256 for the k-quants) -> ``fmt``
    blocks in ggml's order, uint8 [N, K / weights per block * bytes per block].

    Every scale and minimum is stored in float16 (the k-quants' sub-block scales in 6 or 8 bits) and the
    quants are rounded to nearest against the stored values:

    - Q4_1 / Q5_1: per block, m = min, d = (max - min) / 15 (31), q = round((w - m) / d) in [0, 15] ([0, 31]);
    - Q8_0: d = max |w| / 127, q = round(w / d) in [-127, 127];
    - Q4_0 / Q5_0: ggml's reference choice: d = (the value of largest magnitude) / -8 (-16), so that value
      is q = 0; q = round(w / d) + 8 (16) in [0, 15] ([0, 31]);
    - Q4_K / Q5_K: see ``_quantize_k`` (a plain choice, not llama.cpp's search over scales);
    - Q6_K: per 16 weights, s = (the value of largest magnitude) / -32; d = (the s of largest magnitude) /
      -128; the int8 scale sc = s / d rounded away from zero; q = round(w / (d * sc)) + 32 in [0, 63].

    On weights dequantised from blocks that these rules would write (a block's extremes where the rule puts
    them, as llama.cpp's quantisers of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 do), the same blocks come back, so
    the kernel multiplies by exactly those weights. The k-quants make no such promise (their files come from
    llama.cpp's search): their blocks are taken from a file as they are.
    """
    bytes_per_block(fmt)
    _tensor("weight", weight)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(f"weight: quantize takes floating-point weights [N, K], got {weight.dtype} "
                        f"{tuple(weight.shape)}")
    n, k = weight.shape
    per = BLOCK_FORMATS[fmt][0]
    if k % per:
        raise ValueError(f"weight: {fmt} needs an input size that is a multiple of {per}, got {k}")
    if not weight.numel():  # no block to build
        return torch.empty(n, k // per * bytes_per_block(fmt), dtype=torch.uint8)
    w = weight.detach().float().reshape(n, k // per, per)  # [N, B, weights]
    largest = float(w.abs().amax())
    if not largest < F16_ROUNDS_TO_INF:  # NaN compares false too
        raise ValueError(f"weight: {fmt} stores its scales and minimums in float16, so the weights must be finite "
                         f"with |w| < {F16_ROUNDS_TO_INF:g} (float16's largest value is {F16_MAX:g}); got a largest "
                         f"|w| of {largest:g}")
    if fmt in ("q4_1", "q5_1"):
        levels = 15 if fmt == "q4_1" else 31
        lo = w.amin(dim=-1, keepdim=True)  # [N, B, 1]
        hi = w.amax(dim=-1, keepdim=True)
        d16 = ((hi - lo) / levels).half()
        m16 = lo.half()
        d, m = d16.float(), m16.float()
        q = ((w - m) * _inverse(d)).round_().clamp_(0, levels).to(torch.int32)  # [N, B, 32]
        head = torch.cat((d16, m16), dim=-1).view(torch.uint8)  # [N, B, 4]
        qs = _nibbles(q[..., :16], q[..., 16:]).to(torch.uint8)  # [N, B, 16]
        parts = (head, qs) if fmt == "q4_1" else (head, _fifth_bits(q), qs)
    elif fmt == "q8_0":
        amax = w.abs().amax(dim=-1, keepdim=True)
        d16 = (amax / 127).half()
        q8 = (w * _inverse(d16.float())).round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)  # [N, B, 32]
        parts = (d16.view(torch.uint8), q8)
    elif fmt in ("q4_0", "q5_0"):
        half = 8 if fmt == "q4_0" else 16
        extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))  # [N, B, 1], signed
        d16 = (extreme / -half).half()
        q = (w * _inverse(d16.float())).round_().add_(half).clamp_(0, 2 * half - 1).to(torch.int32)
        qs = _nibbles(q[..., :16], q[..., 16:]).to(torch.uint8)
        parts = (d16.view(torch.uint8), qs) if fmt == "q4_0" else (d16.view(torch.uint8), _fifth_bits(q), qs)
    elif fmt in ("q4_k", "q5_k"):
        d16, dmin16, sc, mn, q = _quantize_k(w, 15 if fmt == "q4_k" else 31)  # q [N, B, 8, 32]
        pairs = q.reshape(n, k // per, 4, 2, 32)
        qs = _nibbles(pairs[..., 0, :], pairs[..., 1, :]).reshape(n, k // per, 128).to(torch.uint8)
        head = (d16.view(torch.uint8), dmin16.view(torch.uint8), _pack_k_scales(sc, mn))
        if fmt == "q4_k":
            parts = (*head, qs)
        else:
            qh = (((q >> 4) & 1) * _BIT[:, None]).sum(dim=-2).to(torch.uint8)  # [N, B, 32]: bit j from sub-block j
            parts = (*head, qh, qs)
    elif fmt == "q6_k":
        sub = w.reshape(n, k // per, 16, 16)
        s = sub.gather(-1, sub.abs().argmax(dim=-1, keepdim=True))[..., 0] / -32  # [N, B, 16]
        d16 = (s.gather(-1, s.abs().argmax(dim=-1, keepdim=True)) / -128).half()  # [N, B, 1]
        ratio = s * _inverse(d16.float())
        sc = (ratio.sign() * ratio.abs().ceil()).clamp_(-128, 127)  # away from zero: the block's values fit
        step = d16.float() * sc  # exact in float32
        q = (sub * _inverse(step)[..., None]).round_().add_(32).clamp_(0, 63).to(torch.int32)
        q = q.reshape(n, k // per, 2, 4, 32)  # [N, B, half, quarter, 32]
        ql = torch.cat((_nibbles(q[..., 0, :], q[..., 2, :]), _nibbles(q[..., 1, :], q[..., 3, :])), dim=-1)
        qh = (((q >> 4) & 3) << torch.tensor([0, 2, 4, 6], dtype=torch.int32)[:, None]).sum(dim=-2)
        parts = (ql.reshape(n, k // per, 128).to(torch.uint8), qh.reshape(n, k // per, 64).to(torch.uint8),
                 sc.to(torch.int8).view(torch.uint8), d16.view(torch.uint8))
    else:  # pragma: no cover - bytes_per_block refused it
        raise ValueError(f"unknown block format {fmt!r}; expected one of {list(BLOCK_FORMATS)}")
    blocks = torch.cat(parts, dim=-1)  # [N, B, bytes]
    return blocks.reshape(n, k // per * blocks.shape[-1]).contiguous()


def block_bytes(blocks: torch.Tensor, fmt: str, what: str) -> int:
    """Bytes per block of ``fmt``, once ``blocks`` is checked to be uint8 [N, B * bytes]."""
    size = bytes_per_block(fmt)
    _tensor("blocks", blocks)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise TypeError(f"blocks: {what} takes {fmt} blocks as uint8 [N, a multiple of {size} bytes], got "
                        f"{blocks.dtype} {tuple(blocks.shape)}")
    if blocks.shape[1] % size:
        raise ValueError(f"blocks: {what} takes {fmt} blocks as uint8 [N, a multiple of {size} bytes], got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    return size


@_allocating("blocks")
def pack(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """ggml blocks uint8 [N, B * bytes] -> the kernels' layout (same size). Q4_1 / Q8_0: per row, every
    block's float16 scale ``d``, then (Q4_1) every minimum ``m``, then the quants of block after block (a new
    tensor). Every other format: ggml's layout itself, so ``blocks`` is returned as it is when contiguous
    (no copy: a file's mapped blocks are multiplied in place), else a contiguous copy. A copy is made in a
    :func:`~asyncinfer.kernels.pages.weight_buffer` (huge pages where Linux grants them)."""
    size = block_bytes(blocks, fmt, "pack")
    layout = LAYOUTS[fmt]
    if not layout.regrouped:
        return blocks if blocks.is_contiguous() else in_huge_pages(blocks)
    n = blocks.shape[0]
    nb = blocks.shape[1] // size  # sizes spelled out: N may be 0
    b = blocks.reshape(n, nb, size)  # [N, B, bytes]
    parts = [b[..., 0:2].reshape(n, 2 * nb)]  # d of every block
    if layout.has_min:
        parts.append(b[..., 2:4].reshape(n, 2 * nb))  # m of every block
    parts.append(b[..., layout.head:].reshape(n, layout.quant_bytes * nb))
    out = weight_buffer(n * blocks.shape[1]).view(n, blocks.shape[1])
    return torch.cat(parts, dim=1, out=out)


@_allocating("blocks")
def unpack(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernels' layout back to ggml blocks (the inverse of :func:`pack`; the same tensor for the formats
    the kernels take in ggml's layout)."""
    size = block_bytes(packed, fmt, "unpack")
    layout = LAYOUTS[fmt]
    if not layout.regrouped:
        return packed if packed.is_contiguous() else packed.contiguous()
    n = packed.shape[0]
    nb = packed.shape[1] // size
    d = packed[:, : 2 * nb].reshape(n, nb, 2)
    parts = [d, packed[:, 2 * nb : 4 * nb].reshape(n, nb, 2)] if layout.has_min else [d]
    parts.append(packed[:, layout.head * nb :].reshape(n, nb, layout.quant_bytes))
    return torch.cat(parts, dim=-1).reshape(n, packed.shape[1]).contiguous()


#: Weight rows a group of a format in lanes holds (:func:`pack_lanes`; ``ASYNCINFER_FMT_LANES16``).
LANE_ROWS = 16
#: The name :func:`~asyncinfer.kernels.gemm`, :class:`~asyncinfer.kernels.DecodeLayer` and
#: :class:`~asyncinfer.kernels.DecodeStack` take for Q4_0 in lanes (:func:`pack_lanes`; int8 activations only).
LANES_FORMAT = "q4_0_lanes"
#: Every format in lanes, by its lanes name: the block format whose blocks it regroups (Q4_0, and Q4_1: the same
#: layout with the 16 rows' minimums after their scales).
LANES_FORMATS = {LANES_FORMAT: "q4_0", "q4_1_lanes": "q4_1"}
#: Bytes of a ggml block before its nibbles, per format in lanes: the float16 scale (and Q4_1's minimum).
_LANE_HEADS = {"q4_0": 2, "q4_1": 4}


def lanes_name(fmt: str) -> str:
    """The lanes name of block format ``fmt`` (:data:`LANES_FORMATS`); TypeError for a ``fmt`` that is not a
    ``str`` (as :func:`format_name`), ValueError for a format without lanes."""
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a block format name (str), got {type(fmt).__name__}")
    fmt = str.__str__(fmt)
    for name, base in LANES_FORMATS.items():
        if base == fmt:
            return name
    raise ValueError(f"fmt: only {sorted(LANES_FORMATS.values())} are held in lanes, got {fmt!r}")


def _lane_shape(t: torch.Tensor, fmt: object, what: str, name: str, verb: str) -> tuple[str, int, int, int, int, int]:
    """``t`` checked as ``fmt``'s blocks (a format held in lanes) of a multiple of 16 rows: ``(fmt, bytes per block,
    bytes before its nibbles, rows, blocks a row, groups of 16 rows)``; ValueError (TypeError) naming ``name`` else."""
    if isinstance(fmt, str) and (layout := str.__str__(fmt)) in LANES_FORMATS:  # the layout's name, not the blocks'
        raise ValueError(f"fmt: {what} takes the blocks' own format ({LANES_FORMATS[layout]!r}); {layout!r} names "
                         "the layout in lanes")
    fmt = format_name(fmt, "fmt")
    if fmt not in _LANE_HEADS:
        raise ValueError(f"fmt: {what} regroups {sorted(_LANE_HEADS)} blocks, got {fmt!r}")
    size = block_bytes(t, fmt, what)
    n = t.shape[0]
    if n % LANE_ROWS:
        raise ValueError(f"{name}: {fmt} in lanes {verb} a multiple of {LANE_ROWS} rows, got {n}")
    return fmt, size, _LANE_HEADS[fmt], n, t.shape[1] // size, n // LANE_ROWS


def pack_lanes(blocks: torch.Tensor, fmt: str = "q4_0") -> torch.Tensor:
    """Q4_0 (or Q4_1) blocks in ggml's order, uint8 [N, B * 18] (Q4_1: B * 20) with N a multiple of
    :data:`LANE_ROWS` -> the format in lanes (the same shape and bytes, a new tensor in a
    :func:`~asyncinfer.kernels.pages.weight_buffer`): per group of 16 rows and block, the 16 rows' float16 scales
    (Q4_1: then their 16 minimums), then four runs of 64 bytes, run c holding bytes 4c to 4c + 3 of each row's 16
    bytes of nibbles, row r at bytes 4r to 4r + 3 (csrc/asyncinfer_kernels.h's ASYNCINFER_FMT_LANES16). ValueError
    for another row count or format. ``fmt`` must name the blocks' format: Q4_1 blocks whose rows are also a whole
    number of Q4_0 blocks (K a multiple of 288) cannot be told from Q4_0's by their shape."""
    fmt, size, head, n, nb, groups = _lane_shape(blocks, fmt, "pack_lanes", "blocks", "needs")
    if not blocks.numel():  # no rows or no blocks: nothing to move
        return weight_buffer(0).view(n, blocks.shape[1])
    b = blocks.reshape(groups, LANE_ROWS, nb, size)
    # each block's scale (minimum) and its four runs of four bytes moved as whole int16 / int32 values (a copy of
    # the bytes makes them aligned), a few times faster than moving the bytes one at a time
    scales = b[..., :head].contiguous().view(torch.int16)  # [groups, 16, nb, head / 2]
    quants = b[..., head:].contiguous().view(torch.int32)  # [groups, 16, nb, 4]
    out = weight_buffer(n * blocks.shape[1]).view(groups, nb, size * LANE_ROWS)  # 288 / 320 bytes a block: aligned
    out[..., : head * LANE_ROWS].view(torch.int16).view(groups, nb, head // 2, LANE_ROWS).copy_(
        scales.permute(0, 2, 3, 1))
    out[..., head * LANE_ROWS :].view(torch.int32).view(groups, nb, 4, LANE_ROWS).copy_(quants.permute(0, 2, 3, 1))
    return out.view(n, blocks.shape[1])


@_allocating("blocks")
def unpack_lanes(packed: torch.Tensor, fmt: str = "q4_0") -> torch.Tensor:
    """A format in lanes back to ggml's blocks (the inverse of :func:`pack_lanes`)."""
    fmt, size, head, n, nb, groups = _lane_shape(packed, fmt, "unpack_lanes", "packed", "holds")
    g = packed.reshape(groups, nb, size * LANE_ROWS)
    scales = g[..., : head * LANE_ROWS].reshape(groups, nb, head // 2, LANE_ROWS, 2).permute(0, 3, 1, 2, 4)
    quants = g[..., head * LANE_ROWS :].reshape(groups, nb, 4, LANE_ROWS, 4).permute(0, 3, 1, 2, 4)
    blocks = torch.cat([scales.reshape(groups, LANE_ROWS, nb, head), quants.reshape(groups, LANE_ROWS, nb, 16)], dim=-1)
    return blocks.reshape(n, packed.shape[1]).contiguous()


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of nibbles [..., 16] -> the 32 values, low nibbles first (int32)."""
    qs = qs.to(torch.int32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 bytes of high bits [..., 4] -> [..., 32] values 0 or 16."""
    bits = (qh.to(torch.int32)[..., :, None] >> torch.arange(8, dtype=torch.int32)) & 1  # [..., 4, 8]
    return bits.reshape(*qh.shape[:-1], 32) << 4


@_allocating("blocks")
def dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fmt`` blocks uint8 [N, B * bytes] (ggml's order) -> float32 [N, B * weights per block], as ggml (and
    the kernels) rebuild them: bit for bit what ``gguf.quants.dequantize`` returns."""
    size = block_bytes(blocks, fmt, "dequantize")
    n = blocks.shape[0]
    nb = blocks.shape[1] // size
    per = BLOCK_FORMATS[fmt][0]
    b = blocks.reshape(n, nb, size)  # [N, B, bytes]
    if fmt == "q8_0":
        return (_halves(b, 0) * b[..., 2:].contiguous().view(torch.int8).float()).reshape(n, nb * per)
    if fmt in ("q4_0", "q4_1", "q5_0", "q5_1"):
        d = _halves(b, 0)  # [N, B, 1]
        has_min, five = LAYOUTS[fmt].has_min, LAYOUTS[fmt].bits == 5
        at = 2 + 2 * has_min  # the quants (Q5: qh, then the nibbles)
        q = _low_high(b[..., at + 4 * five:])  # [N, B, 32]
        if five:
            q = q | _qh_bits(b[..., at:at + 4])
        if has_min:  # d * q is exact: d * q + m rounds once, fused or not
            return torch.addcmul(_halves(b, 2), d, q.float()).reshape(n, nb * per)
        return (d * (q - (8 if fmt == "q4_0" else 16)).float()).reshape(n, nb * per)
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _halves(b, 0), _halves(b, 2)  # [N, B, 1]
        sc, mn = _k_scales(b[..., 4:16])  # [N, B, 8]
        at = 16 if fmt == "q4_k" else 48
        qs = b[..., at:at + 128].reshape(n, nb, 4, 1, 32).to(torch.int32)
        q = ((qs >> torch.tensor([0, 4], dtype=torch.int32)[:, None]) & 0x0F).reshape(n, nb, 8, 32)
        if fmt == "q5_k":
            qh = b[..., 16:48].to(torch.int32)[..., None, :]  # [N, B, 1, 32]
            q = q | (((qh >> torch.arange(8, dtype=torch.int32)[:, None]) & 1) << 4)
        scale = (d * sc.float())[..., None]  # [N, B, 8, 1], exact
        offset = (dmin * mn.float())[..., None]
        return (scale * q.float() - offset).reshape(n, nb * per)
    # q6_k
    ql = b[..., :128].reshape(n, nb, 2, 1, 64).to(torch.int32)
    low = ((ql >> torch.tensor([0, 4], dtype=torch.int32)[:, None]) & 0x0F).reshape(n, nb, 2, 4, 32)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32).to(torch.int32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32)[:, None]) & 3  # [N, B, 2, 4, 32]
    q = ((low | (high << 4)) - 32).reshape(n, nb, 16, 16)
    scale = (_halves(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float())[..., None]  # [N, B, 16, 1]
    return (scale * q.float()).reshape(n, nb * per)


class BlockTable:
    """A matrix [rows, cols] held in a block format, read a few rows at a time: :meth:`rows` gathers the rows
    asked for and dequantizes only those, float32, bit for bit the values :func:`dequantize` gives for the whole
    matrix (ggml's own). A model's token embedding kept in its file's blocks is one
    (``models.quant.BlockEmbedding``, and what :class:`~asyncinfer.kernels.DecodeStack` then takes as its
    ``embed``).

    ``blocks``: uint8 [rows, bytes per row], in ggml's order as a file stores them (``packed=False``: a view of
    the file's map is used as it lies) or in the kernels' layout (``packed=True``, :func:`pack`: a head's own
    blocks, ``BlockLinear.kernel_weights()``, read in place); the same bytes for the formats the kernels take in
    ggml's order.

    Raises:
        TypeError / ValueError: ``blocks`` is not contiguous uint8 [rows, a multiple of the format's block bytes]
            on the CPU, or ``fmt`` is not a block format.
    """

    __slots__ = ("_regrouped", "blocks", "fmt", "nbytes", "shape")

    def __init__(self, blocks: torch.Tensor, fmt: str, *, packed: bool = False) -> None:
        fmt = format_name(fmt)
        size = bytes_per_block(fmt)
        _tensor("blocks", blocks, torch.uint8, f"of {fmt} blocks")
        if blocks.dim() != 2 or blocks.shape[1] % size or not blocks.is_contiguous():
            raise ValueError(f"blocks: a {fmt} table is contiguous uint8 [rows, a multiple of {size} bytes], got "
                             f"{tuple(blocks.shape)}{'' if blocks.is_contiguous() else ' (not contiguous)'}")
        self.fmt = fmt
        self.blocks = blocks
        #: (rows, cols): the matrix the blocks hold.
        self.shape = (blocks.shape[0], blocks.shape[1] // size * BLOCK_FORMATS[fmt][0])
        #: The bytes of the blocks.
        self.nbytes = blocks.numel()
        self._regrouped = packed and LAYOUTS[fmt].regrouped  # rows to put back in ggml's order before dequantizing

    @property
    def regrouped(self) -> bool:
        """Whether the rows are in the kernels' layout of Q4_1 / Q8_0 (:func:`pack`: every ``d``, every ``m``, then
        the quants), not ggml's order."""
        return self._regrouped

    @_allocating("rows")
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), cols]: the rows ``ids`` (int64 or int32 [n]) dequantized.

        Raises:
            IndexError: an id outside [0, rows).
        """
        try:
            picked = self.blocks.index_select(0, ids)  # [n, bytes per row]: the only rows read
        except IndexError:
            raise IndexError(f"ids: a row index is outside the table [0, {self.shape[0]})") from None
        if self._regrouped:  # read in place, in a few ops (a decode step's T rows)
            return _dequantize_regrouped(picked, self.fmt)
        return dequantize(picked, self.fmt)


def _dequantize_regrouped(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Q4_1 / Q8_0 rows in the kernels' layout (:func:`pack`: per row every ``d``, Q4_1's every ``m``, then the
    quants) -> float32 [n, cols]: :func:`dequantize`'s arithmetic on :func:`unpack`'s blocks, bit for bit (each
    ``d * q`` is exact in float32), without putting the bytes back in ggml's order first."""
    layout = LAYOUTS[fmt]
    n = rows.shape[0]
    nb = rows.shape[1] // layout.nbytes
    d = rows[:, : 2 * nb].view(torch.float16).float().unsqueeze(-1)  # [n, B, 1]
    if fmt == "q8_0":
        q = rows[:, 2 * nb :].view(torch.int8).view(n, nb, 32).float()  # [n, B, 32]
        return (d * q).view(n, nb * 32)
    m = rows[:, 2 * nb : 4 * nb].view(torch.float16).float().unsqueeze(-1)
    qs = rows[:, 4 * nb :].view(n, nb, 16)  # element j: byte j's low nibble, element j + 16: its high one
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # [n, B, 32]
    return torch.addcmul(m, d, q).view(n, nb * 32)
