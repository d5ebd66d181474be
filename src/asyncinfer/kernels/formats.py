"""ggml's block formats as the kernels hold them: their sizes, the one layout (:func:`pack` /
:func:`unpack`), and the codec (:func:`quantize`, :func:`dequantize`). Pure torch; no compiled code.

:func:`quantize` builds the blocks from float32 weights the way llama.cpp's reference
quantisers do; on weights that were dequantised from blocks of the same type (a GGUF file's), it
returns those blocks again, so the kernel multiplies by exactly the float32 model's weights
(:func:`dequantize` round-trips; the loader checks it per layer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from asyncinfer.kernels._checks import allocating as _allocating
from asyncinfer.kernels._checks import tensor as _tensor


class BlockLayout(NamedTuple):
    """One of ggml's block formats, as a block lies in memory (ggml's order): the float16 scale ``d``,
    then (with a minimum) the float16 minimum ``m``, then the quants: ``bits`` bits each, packed low
    nibbles first for 4 bits (element j in byte j's low nibble, element j + 16 in its high one)."""

    weights: int  #: weights per block
    bits: int  #: bits per quant
    has_min: bool  #: whether a float16 minimum follows the scale (Q4_1)

    @property
    def head(self) -> int:
        """Bytes before the quants: the scale, and the minimum if any."""
        return 2 + 2 * self.has_min

    @property
    def quant_bytes(self) -> int:
        return self.weights * self.bits // 8

    @property
    def nbytes(self) -> int:
        """Bytes per block."""
        return self.head + self.quant_bytes


#: The block formats the kernels multiply by, and the one place their layout is written.
LAYOUTS = {"q4_1": BlockLayout(32, 4, True), "q8_0": BlockLayout(32, 8, False)}
#: Block formats: (weights per block, bytes per block).
BLOCK_FORMATS = {name: (layout.weights, layout.nbytes) for name, layout in LAYOUTS.items()}
#: Every ggml block format asyncinfer reads (the GGUF reader, models/gguf_file.py): the kernels' own and
#: Q4_0, which the reader dequantises (its quants are q - 8: 4 bits, no minimum) but no kernel takes.
READ_LAYOUTS = {**LAYOUTS, "q4_0": BlockLayout(32, 4, False)}
QK = 32
assert all(layout.weights == QK for layout in LAYOUTS.values())


def bytes_per_block(fmt: str, what: str = "fmt") -> int:
    """Bytes per block of ``fmt``: TypeError for a non-string, ValueError for an unknown name (naming ``what``)."""
    if not isinstance(fmt, str):
        raise TypeError(f"{what} must be a block format name, one of {list(BLOCK_FORMATS)}, got "
                        f"{type(fmt).__name__}")
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"{what}: unknown block format {fmt!r}; expected one of {list(BLOCK_FORMATS)}")
    return BLOCK_FORMATS[fmt][1]


def check_blocks(packed: torch.Tensor, fmt: str, out_features: int, k: int, name: str = "packed") -> None:
    """ValueError (TypeError for another device or dtype) naming ``name`` unless ``packed`` is ``fmt``'s
    blocks of ``out_features`` rows of ``k`` inputs, contiguous uint8 on the CPU."""
    size = bytes_per_block(fmt, "fmt" if name == "packed" else f"{name}'s format")
    _tensor(name, packed, torch.uint8, f"of {fmt} blocks")
    if (packed.dtype == torch.uint8 and packed.dim() == 2 and packed.shape[0] == out_features and packed.shape[1]
            and packed.shape[1] % size == 0 and packed.shape[1] // size * QK != k):
        raise ValueError(f"x has {k} columns, but the {fmt} weights hold {packed.shape[1] // size * QK} inputs "
                         f"per row")
    expected = (out_features, k // QK * size)
    if k % QK or packed.dtype != torch.uint8 or tuple(packed.shape) != expected or not packed.is_contiguous():
        raise ValueError(f"{name}: {fmt} weights for {k} inputs and {out_features} outputs are contiguous uint8 "
                         f"{expected} (the input size a multiple of {QK}), got {packed.dtype} {tuple(packed.shape)}"
                         f"{'' if packed.is_contiguous() else ' (not contiguous)'}")


@_allocating("weight")
def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 weights [N, K] (K a multiple of 32) -> ``fmt`` blocks, uint8 [N, K / 32 * bytes per block].

    Q4_1: per block, m = min, d = (max - min) / 15, q = round((w - m) / d) in [0, 15];
    Q8_0: d = max |w| / 127, q = round(w / d). d and m are stored in float16, and q is computed
    against the stored values.
    """
    bytes_per_block(fmt)
    _tensor("weight", weight)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(f"weight: quantize takes floating-point weights [N, K], got {weight.dtype} "
                        f"{tuple(weight.shape)}")
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"weight: {fmt} needs an input size that is a multiple of {QK}, got {k}")
    if not weight.numel():  # no block to build
        return torch.empty(n, k // QK * bytes_per_block(fmt), dtype=torch.uint8)
    w = weight.detach().float().reshape(n, k // QK, QK)  # [N, B, 32]
    if fmt == "q4_1":
        lo = w.amin(dim=-1, keepdim=True)  # [N, B, 1]
        hi = w.amax(dim=-1, keepdim=True)
        d16 = ((hi - lo) / 15).half()
        m16 = lo.half()
        d, m = d16.float(), m16.float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = ((w - m) * inv).round().clamp_(0, 15).to(torch.uint8)  # [N, B, 32]
        packed = q[..., :16] | (q[..., 16:] << 4)  # [N, B, 16]
        head = torch.cat((d16, m16), dim=-1).view(torch.uint8)  # [N, B, 4]
        blocks = torch.cat((head, packed), dim=-1)  # [N, B, 20]
    elif fmt == "q8_0":
        amax = w.abs().amax(dim=-1, keepdim=True)
        d16 = (amax / 127).half()
        d = d16.float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = (w * inv).round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)  # [N, B, 32]
        blocks = torch.cat((d16.view(torch.uint8), q), dim=-1)  # [N, B, 34]
    else:
        raise ValueError(f"unknown block format {fmt!r}; expected one of {list(BLOCK_FORMATS)}")
    return blocks.reshape(n, k // QK * blocks.shape[-1]).contiguous()


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
    """ggml blocks uint8 [N, B * bytes] -> the kernels' layout (same size): per row, every block's
    float16 scale ``d``, then (Q4_1) every minimum ``m``, then the quants of block after block."""
    size = block_bytes(blocks, fmt, "pack")
    n = blocks.shape[0]
    nb = blocks.shape[1] // size  # sizes spelled out: N may be 0
    b = blocks.reshape(n, nb, size)  # [N, B, bytes]
    layout = LAYOUTS[fmt]
    parts = [b[..., 0:2].reshape(n, 2 * nb)]  # d of every block
    if layout.has_min:
        parts.append(b[..., 2:4].reshape(n, 2 * nb))  # m of every block
    parts.append(b[..., layout.head:].reshape(n, layout.quant_bytes * nb))
    return torch.cat(parts, dim=1).contiguous()


@_allocating("blocks")
def unpack(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernels' layout back to ggml blocks (the inverse of :func:`pack`)."""
    size = block_bytes(packed, fmt, "unpack")
    n = packed.shape[0]
    nb = packed.shape[1] // size
    layout = LAYOUTS[fmt]
    d = packed[:, : 2 * nb].reshape(n, nb, 2)
    parts = [d, packed[:, 2 * nb : 4 * nb].reshape(n, nb, 2)] if layout.has_min else [d]
    parts.append(packed[:, layout.head * nb :].reshape(n, nb, layout.quant_bytes))
    return torch.cat(parts, dim=-1).reshape(n, packed.shape[1]).contiguous()


@_allocating("blocks")
def dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fmt`` blocks uint8 [N, B * bytes] -> float32 [N, B * 32], as ggml (and the kernels) rebuild them."""
    size = block_bytes(blocks, fmt, "dequantize")
    n = blocks.shape[0]
    b = blocks.reshape(n, blocks.shape[1] // size, size)  # [N, B, bytes]
    layout = LAYOUTS[fmt]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, B, 1]
    if layout.has_min:  # 4-bit quants and a minimum
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., layout.head:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # [N, B, 32]
        return torch.addcmul(m, d, q).reshape(n, b.shape[1] * QK)  # d * q + m, exact in float32
    q = b[..., layout.head:].contiguous().view(torch.int8).float()
    return (d * q).reshape(n, b.shape[1] * QK)

