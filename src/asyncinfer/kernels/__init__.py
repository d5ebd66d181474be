"""asyncinfer's own CPU kernels: matrix products with weights in ggml's Q4_1 and Q8_0 block formats.

The kernels (``gguf_gemm.c``, AVX2 + FMA + F16C) are compiled on first use with the system's C
compiler into the user cache (``<cache>/asyncinfer/kernels/``), once per source and compiler,
and loaded with ctypes (linked against the OpenMP runtime torch has loaded, so the process keeps
one thread pool); nothing is compiled at install time. A cached build is checked against the
digest its build wrote before it is loaded, and rebuilt when it does not match. Where they cannot run (not x86-64
Linux, a CPU without AVX2/FMA/F16C, no C compiler, a failed build), :func:`available` is False
and :func:`unavailable_reason` says why; the weight formats that need them are then refused with
that reason (``quantization="q4_1"`` / ``"q8_0"``) and ``"auto"`` never picks them.

:func:`quantize` builds the blocks from float32 weights the way llama.cpp's reference
quantisers do; on weights that were dequantised from blocks of the same type (a GGUF file's), it
returns those blocks again, so the kernel multiplies by exactly the float32 model's weights
(:func:`dequantize` round-trips; the loader checks it per layer).
"""


from __future__ import annotations

from asyncinfer.kernels._build import PANEL_MIN_ROWS, available, loaded, unavailable_reason
from asyncinfer.kernels.decoder import DecodeLayer, DecodeStack
from asyncinfer.kernels.formats import BLOCK_FORMATS, QK, dequantize, pack, quantize, unpack
from asyncinfer.kernels.ops import argmax, argmax_takes, decode_attention, gemm, rms_norm

__all__ = [
    "BLOCK_FORMATS", "PANEL_MIN_ROWS", "QK", "DecodeLayer", "DecodeStack", "argmax", "argmax_takes", "available",
    "decode_attention", "dequantize", "gemm", "loaded", "pack", "quantize", "rms_norm", "unavailable_reason", "unpack",
]
