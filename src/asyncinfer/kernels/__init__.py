"""asyncinfer's own CPU kernels: matrix products with weights in ggml's block formats (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0 and the k-quants Q4_K, Q5_K, Q6_K: :data:`BLOCK_FORMATS`), RMS norm, paged decode attention, a
whole decoder layer and a whole decode step, argmax, the token embedding's rows from a table in any of those
block formats (:func:`embed_rows`; the first step of :class:`DecodeStack`).

The C sources (``csrc/``: ``asyncinfer_kernels.h`` carries the ABI) are built into one shared library per
ISA variant: ``scalar`` (the plain-C reference, every machine), ``avx2`` (AVX2 + FMA + F16C), ``avx512``
(AVX-512 F/BW/VL) and ``avx512vnni`` (and AVX-512 VNNI), the x86 ones on x86 only. ``pip install`` builds them (``setup.py``); a checkout on
``PYTHONPATH`` builds them on first use with the system's C compiler into a private user cache
(``<cache>/asyncinfer/kernels/``, or ``$ASYNCINFER_KERNEL_CACHE``). They are loaded with ctypes and share the
OpenMP runtime torch has loaded. The variant is the best this CPU runs, or the one ``ASYNCINFER_KERNEL_ISA``
names (:func:`isa`, :func:`supported_isas`, :func:`build_info`). Where they cannot run (no library and no
compiler, a failed build, an unsafe cache, ``ASYNCINFER_DISABLE_KERNELS``, an ``ASYNCINFER_KERNEL_ISA`` that
names no variant or one this CPU lacks), :func:`available` is False and :func:`unavailable_reason` says why
(neither raises); the weight formats that need them are then refused with that reason
(``quantization="q4_1"``, ``"q4_k"``, ...) and ``"auto"`` never picks them, while :func:`isa` and
:func:`build_info` raise RuntimeError with it. :func:`supported_isas` answers whatever
``ASYNCINFER_KERNEL_ISA`` says (empty where the kernels are disabled or cannot load).

:func:`quantize` builds the blocks from float32 weights; for the 32-weight formats, on weights that were
dequantised from blocks of the same type (a GGUF file's), it returns those blocks again, so the kernel
multiplies by exactly the float32 model's weights (:func:`dequantize` round-trips; the loader checks it per
layer). :mod:`asyncinfer.kernels.formats` holds every format's facts (``LAYOUTS``). :class:`BlockTable` is a
matrix kept in blocks whose rows are dequantized a few at a time (a token embedding in its file's blocks):
:meth:`BlockTable.rows` in torch (the models' reference forward), :func:`embed_rows` and :class:`DecodeStack` in
the kernels, bit for bit the same values. :func:`weight_buffer` is memory for weights in transparent huge pages
where Linux grants them (:func:`huge_pages`; :mod:`asyncinfer.kernels.pages`): :func:`pack` makes its copies there.
"""


from __future__ import annotations

from asyncinfer.kernels._build import (
    BF16_MIN_ROWS,
    INT16_TILE_ISAS,
    LANES_ISAS,
    PANEL_MIN_ROWS,
    STEP_TILE_MIN_ROWS,
    KernelISAError,
    auto_reason,
    available,
    build_info,
    int16_batched,
    isa,
    lanes_native,
    loaded,
    supported_isas,
    unavailable_reason,
)
from asyncinfer.kernels.decoder import MAX_PARTS, MAX_ROPE_TABLES, Activation, DecodeLayer, DecodeStack, RopeTables
from asyncinfer.kernels.formats import (
    ACTIVATION_DTYPES,
    BLOCK_FORMATS,
    F16_ROUNDS_TO_INF,
    INT8_KERNELS,
    LANE_ROWS,
    LANES_FORMAT,
    LANES_FORMATS,
    QK,
    QK_K,
    BlockTable,
    activation_dtype_flag,
    activation_dtype_name,
    dequantize,
    int8_kernel_flag,
    lanes_name,
    pack,
    pack_lanes,
    quantize,
    unpack,
    unpack_lanes,
)
from asyncinfer.kernels.ops import argmax, argmax_takes, decode_attention, embed_rows, gemm, rms_norm
from asyncinfer.kernels.pages import HUGE_PAGE, huge_pages, in_huge_pages, joined_rows, weight_buffer

__all__ = [
    "ACTIVATION_DTYPES",
    "BF16_MIN_ROWS",
    "BLOCK_FORMATS",
    "F16_ROUNDS_TO_INF",
    "HUGE_PAGE",
    "INT8_KERNELS",
    "INT16_TILE_ISAS",
    "LANES_FORMAT",
    "LANES_FORMATS",
    "LANES_ISAS",
    "LANE_ROWS",
    "MAX_PARTS",
    "MAX_ROPE_TABLES",
    "PANEL_MIN_ROWS",
    "QK",
    "QK_K",
    "STEP_TILE_MIN_ROWS",
    "Activation",
    "BlockTable",
    "DecodeLayer",
    "DecodeStack",
    "KernelISAError",
    "RopeTables",
    "activation_dtype_flag",
    "activation_dtype_name",
    "argmax",
    "argmax_takes",
    "auto_reason",
    "available",
    "build_info",
    "decode_attention",
    "dequantize",
    "embed_rows",
    "gemm",
    "huge_pages",
    "in_huge_pages",
    "int8_kernel_flag",
    "int16_batched",
    "isa",
    "joined_rows",
    "lanes_name",
    "lanes_native",
    "loaded",
    "pack",
    "pack_lanes",
    "quantize",
    "rms_norm",
    "supported_isas",
    "unavailable_reason",
    "unpack",
    "unpack_lanes",
    "weight_buffer",
]
