"""Weight formats: how the projection weights of a decoder are stored and multiplied (``quantization=``).

Decode is bound by the bytes of weights read, so a format that moves fewer bytes runs faster.
The formats (values of the engine option ``quantization``):

- ``"auto"`` (default), on a CPU when the dtype is left to the engine (``dtype="auto"``): the
  model's own block format when its GGUF file holds every projection in one (``"q4_1"`` for
  SmolLM2's, ``ModelConfig.native_format``) and asyncinfer's kernels run here; otherwise
  ``"float16"`` where fbgemm runs. Both are the fastest format measured whose greedy output equals
  float32's on the fidelity prompts (benchmarks/quality.py, benchmarks/throughput.py,
  docs/formats.md). Everywhere else (an explicit ``dtype``, CUDA, a CPU without fbgemm) ``None``.
- ``"native"`` (CPU, float32 activations; what ``"auto"`` picks for a GGUF file whose projections
  come in several formats, e.g. llama.cpp's Q4_K_M mixes): each projection and the LM head in the
  format its file stores it in where one of asyncinfer's kernels takes that format (a name of
  :data:`asyncinfer.kernels.formats.LAYOUTS`), built straight from the file's blocks; a fused layer whose
  parts the file stores in different such formats (Q4_K_M's q/k in Q4_K, v in Q6_K) becomes a
  :class:`MixedBlockLinear` of each part's own blocks (its stored format a :func:`mixed_format`); every other
  one (a format no kernel takes, a float tensor, a fused layer with such a part) in float16 where
  fbgemm runs, else float32, dequantised one tensor at a time. ``ModelConfig.stored_formats`` says
  which is which, so the memory planner counts the same bytes before loading.
- ``None``: the engine dtype. On a CPU in float32 the projection weights are also
  packed once at load into oneDNN's blocked layout (``pack_weights``, on by default where
  oneDNN exists): the same float32 values, a faster kernel, results within float32 rounding.
- ``"float16"`` (CPU, float32 activations): weights stored in float16, multiplied by fbgemm's
  fp16 kernel with float32 accumulation. Half the bytes; deterministic on every x86 CPU.
- ``"q4_1"`` / ``"q8_0"`` (CPU, float32 activations): ggml's block formats, multiplied by
  asyncinfer's own AVX2 kernels (:mod:`asyncinfer.kernels`; refused where they cannot run).
  ``"q4_1"`` keeps the LM head in Q8_0. On a GGUF file stored in the same blocks they hold exactly
  the file's weights (``BlockLinear.lossless``); a step of decodes runs as one kernel call
  (:class:`asyncinfer.models.decode_backends.KernelDecode`).
- ``"q4_0"``, ``"q5_0"``, ``"q5_1"`` and the k-quants ``"q4_k"``, ``"q5_k"``, ``"q6_k"``: ggml's other block
  formats on the same kernels (docs/formats.md). The 32-weight ones keep the head in Q8_0, the k-quants in
  Q6_K; a projection whose input size is not a multiple of a k-quant's 256 takes llama.cpp's fallback
  (:data:`K_QUANT_FALLBACK`: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Their quantizer is a plain one
  (:func:`asyncinfer.kernels.quantize`): a GGUF file's own k-quant blocks are taken as they are.
  Every block format takes the engine's ``activation_dtype`` (:data:`asyncinfer.kernels.ACTIVATION_DTYPES`): int16
  (the default) rounds a step's activations per run of 32 (a step of ``PANEL_MIN_ROWS`` tokens or more: in the
  AVX-512 kernel variants; the others multiply bigger steps in float32); int8 (llama.cpp's numerics, faster) rounds
  every step's activations per run of 32 (the k-quants' per 256 on the AVX-512 builds); bfloat16 is int16 below ``BF16_MIN_ROWS`` tokens and multiplies bigger steps in bfloat16 (AMX CPUs),
  :attr:`BlockLinear.activation_dtype`.
- ``"int8"`` (CPU, float32 activations): int8 weights, symmetric per output channel in
  [-64, 64], and activations quantized per call per tensor to 8 bits (fbgemm's dynamic kernel).
  Without VNNI, fbgemm's AVX2 kernel adds pairs of uint8 x int8 products in int16 with
  saturation; with weights within +-64 a pair is at most 2 x 255 x 64 = 32640 < 32767, so
  nothing saturates and the result is the same exact integer arithmetic on every x86 CPU.
  (The other non-saturating choice, 7-bit activations with ``reduce_range=True``, loses more:
  ``benchmarks/quality.py`` measured both.) Layers named in ``quantization_skip`` stay float32.
- On CUDA, ``"float16"`` and ``"bfloat16"`` mean the engine dtype (weights, activations, KV cache).

``benchmarks/quality.py`` measures what each format costs in quality on the real model,
``benchmarks/weight_formats.py`` what it gains in speed.

:func:`weight_bytes` is the one weight-size calculation of the package: from the config alone it
counts what :func:`apply_weight_format` leaves (the memory planner before loading and the
start-up path after it both use it).

:func:`apply_weight_format` builds each layer from the model's own weights, or, given a ``source``
(the GGUF loader's, :class:`StoredProjection`), from the checkpoint's tensors one layer at a time:
a layer whose format is the one its file stores it in is made from those blocks
(:meth:`BlockLinear.from_blocks`: repacked once into the kernels' layout, never through float32).
From a file, under a block format or ``"native"``, the token embedding stays in the blocks the file stores it
in too (:class:`BlockEmbedding`: a lookup dequantizes only its rows; a tied head in those blocks is the one
copy; :func:`embedding_formats`), instead of a float32 table of vocab x hidden x 4 bytes.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from asyncinfer import kernels
from asyncinfer.errors import InvalidParameterError, ModelLoadError
from asyncinfer.models.meta import build_on_meta

if TYPE_CHECKING:
    from asyncinfer.models.config import ModelConfig

#: The formats in ggml's block layouts, multiplied by asyncinfer's own kernels (asyncinfer.kernels).
BLOCK_FORMATS = tuple(kernels.BLOCK_FORMATS)
#: Each projection in the format its GGUF file stores it in where a kernel takes it (see the module).
NATIVE = "native"
#: Format names per device type (values of ``quantization`` besides None).
CPU_FORMATS = ("float16", "int8", *BLOCK_FORMATS, NATIVE)
CUDA_FORMATS = ("float16", "bfloat16")
QUANTIZATION_METHODS = ("float16", "bfloat16", "int8", *BLOCK_FORMATS, NATIVE)
#: The LM head's format under each block format: the 32-weight formats keep the head in Q8_0, as
#: llama.cpp's Q4 files do (SmolLM2's GGUF: Q4_1 layers, a Q8_0 embedding tied to the head); the
#: k-quants in Q6_K, as llama.cpp's Q4_K_M / Q5_K_M files do.
BLOCK_HEAD_FORMAT = {"q8_0": "q8_0", "q4_1": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "q5_1": "q8_0",
                     "q4_k": "q6_k", "q5_k": "q6_k", "q6_k": "q6_k"}
#: A k-quant projection whose input size is not a multiple of 256 takes this 32-weight format instead
#: (llama.cpp's own fallback when it quantizes such a tensor).
K_QUANT_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}

#: The default ``quantization_skip`` of each format. int8: chosen by ``benchmarks/quality.py
#: --sensitivity`` on SmolLM2-135M (benchmarks/results/quality.json): the MLP down projection, whose
#: inputs carry SwiGLU's outliers, is the most sensitive kind by far, then the LM head. Keeping both
#: in float32 gave 88.5% teacher-forced top-1 agreement (int8 everywhere: 75.1%, all but down_proj:
#: 85.0%); no list that still quantizes most weights reaches the issue's 97%.
DEFAULT_SKIP: dict[str | None, tuple[str, ...]] = {
    None: (), "float16": (), "bfloat16": (), "int8": ("down_proj", "lm_head"), **{fmt: () for fmt in BLOCK_FORMATS},
    NATIVE: (),
}

#: The values of ``activation_dtype`` (``EngineConfig``, :attr:`BlockLinear.activation_dtype`).
ACTIVATION_DTYPES = kernels.ACTIVATION_DTYPES


def _allowed(device_type: str) -> str:
    if device_type == "cuda":
        return (f"'auto', None, 'float16' or 'bfloat16' on CUDA (the engine dtype; 'int8', {NATIVE!r} and the block "
                f"formats {', '.join(map(repr, BLOCK_FORMATS))} run on CPU only)")
    return (f"'auto', None, {', '.join(map(repr, CPU_FORMATS[:-1]))} or {CPU_FORMATS[-1]!r} on CPU, with float32 "
            f"activations ('bfloat16' is a CUDA format)")


#: What users type for a format asyncinfer does not have (llama.cpp's file types, other libraries' names), and
#: the nearest format it has, with why: the hint of :func:`check_quantization`'s error.
_NEAREST: dict[str, tuple[str, str]] = {
    **{name: ("q4_k", ("llama.cpp's Q4_K_M/Q4_K_S mix Q4_K with Q6_K; q4_k is every projection in Q4_K, the head in "
                      "Q6_K, and native keeps a Q4_K_M file's own mix"))
       for name in ("q4_k_m", "q4_k_s", "q4_k_l", "q3_k", "q3_k_m", "q3_k_s", "q3_k_l", "q2_k", "q2_k_s")},
    **{name: ("q5_k", ("llama.cpp's Q5_K_M/Q5_K_S mix Q5_K with Q6_K; q5_k is every projection in Q5_K, the head in "
                      "Q6_K, and native keeps such a file's own mix"))
       for name in ("q5_k_m", "q5_k_s")},
    **{name: ("native", "a GGUF file's own formats are quantization='native' (or 'auto', the default, on a CPU)")
       for name in ("gguf", "ggml", "file", "own", "original")},
    **{name: ("q4_0", "4-bit weights are the block formats q4_0 / q4_1 / q4_k (asyncinfer's CPU kernels)")
       for name in ("int4", "4bit", "4-bit", "q4", "nf4", "fp4", "awq", "gptq", "bnb", "bitsandbytes", "iq4_nl",
                    "iq4_xs")},
    **{name: ("q5_0", "5-bit weights are the block formats q5_0 / q5_1 / q5_k") for name in ("q5", "int5", "5bit")},
    **{name: ("q8_0", "8-bit weights are q8_0 (llama.cpp's Q8_0 blocks) or int8 (per-channel)")
       for name in ("q8", "8bit", "8-bit", "fp8", "f8", "float8")},
    **{name: ("q6_k", "6-bit weights are q6_k") for name in ("q6", "6bit")},
    **{name: ("float16", "16-bit float weights are float16 ('bfloat16' on CUDA)") for name in ("fp16", "f16", "half")},
    **{name: ("bfloat16", "bfloat16 weights are 'bfloat16' (CUDA)") for name in ("bf16",)},
    **{name: ("none", "float32 weights (the dtype's own) are quantization=None (--quantization none)")
       for name in ("fp32", "f32", "float32", "float", "full", "no", "off", "false")},
}


def spelled_quantization(method: object) -> object:
    """``method`` as the engine names its formats: a supported format or "auto" in any case and with spaces
    around (``"Q4_1"``, ``" AUTO"``) in lower case, and ``"none"`` (any case) as None; anything else as given
    (refused by :func:`check_quantization`, with the nearest format)."""
    if not isinstance(method, str):
        return method
    spelled = method.strip().lower()
    if spelled == "none":
        return None
    return spelled if spelled == "auto" or spelled in QUANTIZATION_METHODS else method


def nearest_quantization(method: object) -> str:
    """The hint that ends an unknown format's error: the nearest format there is ("; nearest: 'q4_k' (...)"),
    or "" when nothing is near."""
    import difflib

    if not isinstance(method, str):
        return ""
    key = method.strip().lower().replace("-", "_").replace(" ", "")
    if key.replace("_", "") in {k.replace("_", "") for k in _NEAREST}:
        key = next(k for k in _NEAREST if k.replace("_", "") == key.replace("_", ""))
    if key in _NEAREST:
        fmt, why = _NEAREST[key]
        return f"; nearest: {fmt!r} ({why})"
    close = difflib.get_close_matches(key, (*QUANTIZATION_METHODS, "auto"), n=1, cutoff=0.6)
    return f"; nearest: {close[0]!r}" if close else ""


def fp16_weights_available() -> bool:
    """Whether fbgemm's float16-weight kernel runs here (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_quantization(method: object, device: torch.device, dtype: object, native_format: str | None = None) -> object:
    """``quantization="auto"`` made concrete for ``device`` and the ``dtype`` option as given (before
    it is resolved). On a CPU with ``dtype`` "auto" (or None): the model's ``native_format`` (its GGUF
    file's own block format, or "native" for a file of several formats: ``ModelConfig.native_format``) where asyncinfer's kernels run (a vectorised
    variant, or the scalar reference when ``ASYNCINFER_KERNEL_ISA`` asks for it: ``kernels.auto_reason()``),
    else "float16" where fbgemm runs; everywhere else None. Any other value is returned as is (validated
    by :func:`check_quantization`). The format's name is read in any case (:func:`spelled_quantization`)."""
    method = spelled_quantization(method)
    if method != "auto":
        return method
    if device.type != "cpu" or dtype not in (None, "auto"):
        return None
    if (native_format in BLOCK_FORMATS or native_format == NATIVE) and kernels.auto_reason() is None:
        # kernels that run, vectorised or asked for
        return native_format
    return "float16" if fp16_weights_available() else None


def smaller_cpu_formats(method: str | None) -> tuple[str, ...]:
    """The CPU formats (float32 activations) that store fewer weight bytes than ``method``, smallest last:
    what a refusal or a plan suggests when the weights do not fit."""
    smaller = {None: ("float16", "int8", "q8_0", "q4_1"), "float16": ("int8", "q8_0", "q4_1"),
               "int8": ("q8_0", "q4_1"), "q8_0": ("q4_1",)}.get(method, ())
    return tuple(m for m in smaller if m not in BLOCK_FORMATS or kernels.available())


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Validate the ``quantization`` option against the device and the (resolved) dtype.

    Raises:
        InvalidParameterError: naming ``quantization`` and the values allowed on ``device``.
    """
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise InvalidParameterError("quantization", method, _allowed(device.type) + nearest_quantization(method))
    if device.type == "cuda":
        if method not in CUDA_FORMATS or dtype != getattr(torch, method):
            raise InvalidParameterError("quantization", method, _allowed("cuda") + f"; it must match dtype={dtype}")
    elif method not in CPU_FORMATS:
        raise InvalidParameterError("quantization", method, _allowed("cpu"))
    elif (method in BLOCK_FORMATS or method == NATIVE) and not kernels.available():
        allowed = f"'auto', None, 'float16' or 'int8' here: asyncinfer's {method} kernel cannot run ({kernels.unavailable_reason()})"
        raise InvalidParameterError("quantization", method, allowed)
    elif dtype != torch.float32:
        allowed = f"{_allowed('cpu')}; a CPU format needs dtype float32 or 'auto', not {str(dtype).removeprefix('torch.')}"
        raise InvalidParameterError("quantization", method, allowed)


def format_dtype(method: str | None, device: torch.device, dtype: object) -> object:
    """The dtype option to resolve: on CUDA, a dtype format with ``dtype="auto"`` sets the dtype."""
    if device.type == "cuda" and method in CUDA_FORMATS and dtype in (None, "auto"):
        return method
    return dtype


def default_skip(method: str | None) -> tuple[str, ...]:
    """The format's default ``quantization_skip`` (an unknown name gets none; it is refused elsewhere)."""
    return DEFAULT_SKIP.get(method, ())


def resolve_skip(method: str | None, skip: object) -> tuple[str, ...]:
    """``quantization_skip`` as a tuple: None is the format's own (:func:`default_skip`).

    Raises:
        InvalidParameterError: not a tuple or list of non-empty strings (an empty one is a substring of every
            layer's name: it kept every projection in float32).
    """
    if skip is None:
        return default_skip(method)
    if (isinstance(skip, str) or not isinstance(skip, (tuple, list))
            or not all(isinstance(s, str) and s.strip() for s in skip)):
        raise InvalidParameterError("quantization_skip", skip, "a tuple of non-empty layer-name substrings, or None")
    return tuple(skip)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float32 weights can be packed for oneDNN here: a CPU, float32, torch built with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def resolve_pack(pack_weights: object, device: torch.device, dtype: torch.dtype) -> bool:
    """``pack_weights``: None (auto: wherever :func:`can_pack`), True (required) or False (never).

    Raises:
        InvalidParameterError: not a bool or None, or True where packing cannot run.
    """
    if pack_weights is None:
        return can_pack(device, dtype)
    if not isinstance(pack_weights, bool):
        raise InvalidParameterError("pack_weights", pack_weights, "None (auto), True or False")
    if pack_weights and not can_pack(device, dtype):
        raise InvalidParameterError(
            "pack_weights", pack_weights, "None or False here: packing needs a CPU, dtype float32 and oneDNN"
        )
    return pack_weights


class FormatLinear(nn.Module):
    """``y = x @ W.T + b`` with W held in a kernel's own format; ``nbytes`` is what that format stores."""

    in_features: int
    out_features: int
    nbytes: int
    kind = ""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().contiguous()


class PackedLinear(FormatLinear):
    """float32 weights reordered once into oneDNN's blocked layout; the same values, a faster CPU kernel."""

    kind = "float32 oneDNN-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous())
        self._bias = _float_bias(bias)
        self.nbytes = linear_bytes("float32", self.out_features, self.in_features, bias=bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # oneDNN builds (and caches, ~0.6 MB each) a kernel per row count: every row count a step can
        # have would grow the process by hundreds of MB. Inputs are padded to a few row counts.
        rows = x.shape[0]
        padded = packed_rows(rows)
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self._packed, self._bias, "none", [], "")  # [T, out]
        return out if padded == rows else out[:rows]


def packed_rows(rows: int) -> int:
    """The row count a PackedLinear runs ``rows`` as: exact up to 16, then rounded up to one of 8
    sizes per doubling (at most 12.5% more rows; 72 sizes up to 2048 rows)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


#: float16's largest finite value (65504): a float weight that rounds past it (|w| >= 65520) is refused, not stored as
#: an inf; one in (65504, 65520) is stored as 65504, the float16 it rounds to.
FLOAT16_MAX = torch.finfo(torch.float16).max


class Fp16Linear(FormatLinear):
    """float16 weights (fbgemm's packed fp16 matrix), float32 activations and accumulation."""

    kind = "float16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        largest = float(w.abs().amax()) if w.numel() else 0.0
        if not largest < kernels.F16_ROUNDS_TO_INF:  # (a NaN too): fbgemm would pack an inf or a NaN, and every output it feeds
            got = ("a NaN" if math.isnan(largest) else f"a largest |w| of {largest:g}"
                   + ("" if math.isinf(largest) else ", which rounds to an infinity"))  # a NaN rounds to no infinity
            raise ValueError(f"weight: float16 holds magnitudes up to {FLOAT16_MAX:g} and no NaN; got {got}")
        if largest > FLOAT16_MAX:  # rounds to 65504: stored so, without the packer's warning that it saturated
            w = w.clamp(-FLOAT16_MAX, FLOAT16_MAX)
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, _float_bias(bias))
        self.nbytes = linear_bytes("float16", self.out_features, self.in_features, bias=bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)  # [T, out]


#: The largest int8 weight magnitude: 2 x 255 x 64 fits int16, so AVX2's pair sums never saturate.
INT8_WEIGHT_MAX = 64


class Int8DynamicLinear(FormatLinear):
    """int8 weights in [-64, 64] (per-channel scales) in fbgemm's packed format; activations quantized per call."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        if w.numel() and not bool(torch.isfinite(w).all()):  # (torch's own refusal names no weight nor value)
            raise ValueError(f"weight: int8 scales each row by its largest |w|, so the weights must be finite; got a "
                             f"largest |w| of {float(w.abs().amax()):g}")
        scale = (w.abs().amax(dim=1) / INT8_WEIGHT_MAX).clamp_min(1e-12)  # [out]
        zero = torch.zeros(w.shape[0], dtype=torch.long)  # [out]
        with warnings.catch_warnings():  # torch flags its quantized-tensor API as deprecated
            warnings.simplefilter("ignore")
            wq = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)  # [out, in], in [-64, 64]
        self._packed = torch.ops.quantized.linear_prepack(wq, _float_bias(bias))
        self.nbytes = linear_bytes("int8", self.out_features, self.in_features, bias=bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range=False: 8-bit activations, safe because the weights stay within +-64 (see the module).
        return torch.ops.quantized.linear_dynamic(x, self._packed, False)  # [T, out]


class BlockLinear(FormatLinear):
    """Weights in one of ggml's block formats (:data:`BLOCK_FORMATS`: one subclass each, ``fmt`` its name),
    float32 activations, asyncinfer's kernels (:mod:`asyncinfer.kernels`).

    ``lossless``: whether the blocks rebuild exactly the float32 weights they were made from (true
    for weights a GGUF file held in the same format: the float32 model and this layer then multiply
    by the same numbers). ``activation_dtype``: how a step rounds its activations, ``"int16"``, ``"int8"`` or
    ``"bfloat16"`` (:func:`asyncinfer.kernels.gemm`'s; ValueError for another value), fixed at construction; with int8,
    ``int8_kernel`` (:data:`asyncinfer.kernels.INT8_KERNELS`): ``"tile"`` (default) for a decoder layer's
    projection, which meets a prefill's every token, ``"rows"`` for the output projection, which meets a row per
    sampled request (the kernels' one-call decode step chooses its head's kernel itself:
    :class:`asyncinfer.kernels.DecodeStack`).

    ``lanes``: whether the blocks are held in lanes (:func:`asyncinfer.kernels.pack_lanes`, 16 weight rows a
    register), chosen once at construction for a Q4_0 or Q4_1 decoder-layer projection (``int8_kernel="tile"``) with
    int8 activations and a multiple of 16 output rows where the kernels run the lanes in vector code
    (:func:`asyncinfer.kernels.lanes_native`): a decode step's GEMM then reads 16 weight rows a register, and a
    prefill's tile reads each row out of its group, with the same results as the layout of ggml's blocks gives the
    tile (docs/formats.md, "Q4_0 in lanes"). :meth:`kernel_weights` names the layout
    (:data:`asyncinfer.kernels.LANES_FORMATS`: ``"q4_0_lanes"``, ``"q4_1_lanes"``).
    """

    fmt = ""
    _CHUNK_ROWS = 4096
    activation_dtype = "int16"
    int8_kernel = "tile"
    lanes = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, activation_dtype: str = "int16",
                 int8_kernel: str = "tile") -> None:
        super().__init__()
        self._set_activation_dtype(activation_dtype, int8_kernel)
        w = weight.detach()
        out_features, in_features = w.shape
        self.lanes = self._takes_lanes(out_features)
        packed, lossless = [], True
        for rows in w.split(self._CHUNK_ROWS):  # a chunk at a time (16-row groups whole): small temporaries at load
            rows = rows.float()
            blocks = kernels.quantize(rows, self.fmt)  # ggml blocks [rows, in / block weights * block bytes]
            lossless = lossless and bool(torch.equal(kernels.dequantize(blocks, self.fmt), rows))
            packed.append(self._layout(blocks))  # the same bytes in the layer's layout
        # joined in a weight buffer too (huge pages where granted), as each chunk's copy is
        self._hold(packed[0] if len(packed) == 1 else kernels.joined_rows(packed), out_features, in_features, bias,
                   lossless)

    def _set_activation_dtype(self, activation_dtype: str, int8_kernel: str) -> None:
        self.activation_dtype = kernels.activation_dtype_name(activation_dtype)
        self.int8_kernel = "tile" if kernels.int8_kernel_flag(int8_kernel) else "rows"

    def _takes_lanes(self, out_features: int) -> bool:
        """Whether this layer holds its blocks in lanes (:attr:`lanes`), decided once from its format, activations,
        kernel and rows, and the loaded kernels (:func:`asyncinfer.kernels.lanes_native`)."""
        return (self.fmt in kernels.LANES_FORMATS.values() and self.activation_dtype == "int8"
                and self.int8_kernel == "tile" and out_features % kernels.LANE_ROWS == 0 and kernels.available()
                and kernels.lanes_native())

    def _layout(self, blocks: torch.Tensor) -> torch.Tensor:
        """ggml's blocks in the layer's layout: in lanes (:func:`asyncinfer.kernels.pack_lanes`) or the kernels'
        (:func:`asyncinfer.kernels.pack`); a copy of the same size, or the blocks themselves where that layout is
        ggml's."""
        return kernels.pack_lanes(blocks, self.fmt) if self.lanes else kernels.pack(blocks, self.fmt)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, bias: torch.Tensor | None, *, activation_dtype: str = "int16",
                    int8_kernel: str = "tile") -> BlockLinear:
        """The layer of ggml blocks in the class's format as a file stores them, uint8
        [out, in / per block * bytes per block] (e.g. a view of a GGUF file's memory map): repacked once into
        the kernels' layout (:func:`asyncinfer.kernels.pack`, a copy of the same size;
        :func:`asyncinfer.kernels.pack_lanes` where the layer takes the lanes, :attr:`lanes`), never through float32;
        ``lossless``."""
        layer = cls.__new__(cls)
        FormatLinear.__init__(layer)
        layer._set_activation_dtype(activation_dtype, int8_kernel)
        per_block, size = kernels.BLOCK_FORMATS[cls.fmt]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
            raise ValueError(f"blocks: {cls.fmt} blocks are uint8 [out, a multiple of {size} bytes], got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        layer.lanes = layer._takes_lanes(blocks.shape[0])
        layer._hold(layer._layout(blocks), blocks.shape[0], blocks.shape[1] // size * per_block, bias, True)
        return layer

    def _hold(self, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
              lossless: bool) -> None:
        self.out_features, self.in_features, self.lossless = out_features, in_features, lossless
        self._blocks = packed  # ggml's blocks as a file maps them where the layout is ggml's, else a copy
        self._bias = _float_bias(bias)
        self.nbytes = linear_bytes(self.fmt, self.out_features, self.in_features, bias=bias is not None)

    @property
    def kind(self) -> str:  # type: ignore[override]
        act = f", {self.activation_dtype} activations" if self.activation_dtype != "int16" else ""
        lanes = ", in lanes" if self.lanes else ""
        return f"{self.fmt} ({'lossless' if self.lossless else 'lossy'}{act}{lanes})"

    def kernel_weights(self) -> tuple[str, torch.Tensor, torch.Tensor | None]:
        """``(format, blocks, float32 bias or None)``: this layer's weights as :func:`asyncinfer.kernels.gemm`
        and :class:`asyncinfer.kernels.DecodeLayer` take them (the tensors themselves, not copies); the format is its
        lanes name (:func:`asyncinfer.kernels.lanes_name`) for blocks held in lanes (:attr:`lanes`)."""
        return (kernels.lanes_name(self.fmt) if self.lanes else self.fmt), self._blocks, self._bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        if torch.autograd.profiler._is_profiler_enabled:  # named in traces like any torch op
            with torch.profiler.record_function(f"asyncinfer::gemm_{self.fmt}"):
                out = kernels.gemm(x2, self._blocks, self.fmt, self.out_features, self._bias,
                                   activation_dtype=self.activation_dtype, int8_kernel=self.int8_kernel,
                                   lanes=self.lanes)
        else:
            out = kernels.gemm(x2, self._blocks, self.fmt, self.out_features, self._bias,
                               activation_dtype=self.activation_dtype, int8_kernel=self.int8_kernel, lanes=self.lanes)
        return out.view(*lead, self.out_features)  # [..., out]


class Q4_1Linear(BlockLinear):
    """ggml's Q4_1: blocks of 32 weights, d * q + m with q in [0, 15] (5 bits per weight)."""

    fmt = "q4_1"


class Q8_0Linear(BlockLinear):
    """ggml's Q8_0: blocks of 32 weights, d * q with q in [-127, 127] (8.5 bits per weight)."""

    fmt = "q8_0"


class Q4_0Linear(BlockLinear):
    """ggml's Q4_0: blocks of 32 weights, d * (q - 8) with q in [0, 15] (4.5 bits per weight)."""

    fmt = "q4_0"


class Q5_0Linear(BlockLinear):
    """ggml's Q5_0: blocks of 32 weights, d * (q - 16) with q in [0, 31] (5.5 bits per weight)."""

    fmt = "q5_0"


class Q5_1Linear(BlockLinear):
    """ggml's Q5_1: blocks of 32 weights, d * q + m with q in [0, 31] (6 bits per weight)."""

    fmt = "q5_1"


class Q4_KLinear(BlockLinear):
    """ggml's Q4_K: super-blocks of 256 weights, eight sub-blocks of 32 with 6-bit scales and minimums
    (4.5 bits per weight)."""

    fmt = "q4_k"


class Q5_KLinear(BlockLinear):
    """ggml's Q5_K: Q4_K with a fifth bit per quant (5.5 bits per weight)."""

    fmt = "q5_k"


class Q6_KLinear(BlockLinear):
    """ggml's Q6_K: super-blocks of 256 weights, 6-bit quants, an int8 scale per 16 (6.5625 bits per weight)."""

    fmt = "q6_k"


class MixedBlockLinear(FormatLinear):
    """A projection whose output rows are runs in different block formats: :class:`BlockLinear` parts (1 to
    :data:`asyncinfer.kernels.MAX_PARTS`) stacked row-wise, e.g. a fused q/k/v whose file holds q and
    k in Q4_K and v in Q6_K (llama.cpp's Q4_K_M). ``y = [part_0(x), part_1(x), ...]`` along the last
    dimension; the fused decoder multiplies each run in its own format
    (:class:`asyncinfer.kernels.DecodeLayer`'s parts).

    Raises:
        TypeError: a part that is not a :class:`BlockLinear`.
        ValueError: no part, more than ``MAX_PARTS``, or parts of different input sizes or ``activation_dtype``.
    """

    def __init__(self, parts: Iterable[BlockLinear]) -> None:
        super().__init__()
        parts = list(parts)
        if not 1 <= len(parts) <= kernels.MAX_PARTS:
            raise ValueError(f"parts: a MixedBlockLinear has 1 to {kernels.MAX_PARTS} parts, got {len(parts)}")
        for i, part in enumerate(parts):
            if not isinstance(part, BlockLinear):
                raise TypeError(f"parts[{i}] must be a BlockLinear, got {type(part).__name__}")
            if part.in_features != parts[0].in_features:
                raise ValueError(f"parts[{i}] takes {part.in_features} inputs, parts[0] {parts[0].in_features}")
            if part.activation_dtype != parts[0].activation_dtype:
                raise ValueError(f"parts[{i}] takes {part.activation_dtype} activations, parts[0] {parts[0].activation_dtype}")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.nbytes = sum(part.nbytes for part in parts)
        biases = [part.kernel_weights()[2] for part in parts]
        self._bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)])

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "mixed (" + ", ".join(part.kind for part in self.parts) + ")"

    @property
    def lossless(self) -> bool:
        return all(part.lossless for part in self.parts)

    @property
    def activation_dtype(self) -> str:
        """The parts' :attr:`BlockLinear.activation_dtype` (one value: checked at construction)."""
        return self.parts[0].activation_dtype

    def kernel_weights(self) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``((format, ...), (blocks, ...), float32 bias or None)``: the parts' formats and blocks (the tensors
        themselves) as :class:`asyncinfer.kernels.DecodeLayer` takes a projection of several formats."""
        weights = [part.kernel_weights() for part in self.parts]
        return tuple(w[0] for w in weights), tuple(w[1] for w in weights), self._bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)  # [..., out]


class BlockEmbedding(nn.Module):
    """The token embedding [vocab, hidden] kept in the block format its GGUF file stores it in (a
    :class:`asyncinfer.kernels.BlockTable`), never as a float32 table: a lookup dequantizes only the rows of the
    ids asked for, float32, bit for bit what a float32 table of the same file holds
    (:meth:`GGUFFile.dequantize <asyncinfer.models.gguf_file.GGUFFile.dequantize>`), so every output is today's.
    Made by :func:`apply_weight_format` from a file's blocks (:func:`embedding_formats` says when); an embedding
    tied to a head built from the same blocks reads that head's blocks (``shared``: one copy).

    ``nbytes``: the bytes it holds of its own (0 when ``shared``: they are the head's).
    """

    def __init__(self, table: kernels.BlockTable, *, shared: bool = False) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.shape
        self.shared = shared
        self.nbytes = 0 if shared else table.nbytes

    @property
    def fmt(self) -> str:
        return self.table.fmt

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"
                + (" (the head's blocks)" if self.shared else ""))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 [*input_ids.shape, hidden]: the ids' rows.

        Raises:
            IndexError: an id outside [0, vocab), as an ``nn.Embedding`` does.
        """
        try:
            rows = self.table.rows(input_ids.reshape(-1))  # [n, hidden]
        except IndexError:
            raise IndexError(f"input_ids: a token id is outside the embedding table [0, {self.num_embeddings})"
                             ) from None
        return rows.view(*input_ids.shape, self.embedding_dim)


_LAYERS: dict[str, type[FormatLinear]] = {
    "float32": PackedLinear, "float16": Fp16Linear, "int8": Int8DynamicLinear,
    **{layer.fmt: layer for layer in (Q4_1Linear, Q8_0Linear, Q4_0Linear, Q5_0Linear, Q5_1Linear, Q4_KLinear,
                                      Q5_KLinear, Q6_KLinear)},
}
assert all(fmt in _LAYERS for fmt in BLOCK_FORMATS)


#: Joins the parts of a mixed stored format (:func:`mixed_format`).
MIXED_SEPARATOR = "+"


def mixed_format(parts: Iterable[tuple[str, int]]) -> str:
    """The stored format of a fused projection whose runs of rows come in different formats: each part's format
    and row count, in row order, e.g. ``"q4_k:576+q4_k:192+q6_k:192"`` (a Q4_K_M file's q/k/v). What
    ``ModelConfig.stored_formats`` records for it, and under ``"native"`` the layer's format
    (a :class:`MixedBlockLinear`) when every part is in a block format a kernel takes."""
    return MIXED_SEPARATOR.join(f"{fmt}:{rows}" for fmt, rows in parts)


def mixed_parts(fmt: str | None) -> tuple[tuple[str, int], ...]:
    """``(format, rows)`` of each part of a :func:`mixed_format`; () for any other format."""
    if not fmt or ":" not in fmt:
        return ()
    parts = []
    for part in fmt.split(MIXED_SEPARATOR):
        name, _, rows = part.partition(":")
        parts.append((name, int(rows)))
    return tuple(parts)


def _kernel_mixed(fmt: str | None, in_features: int) -> bool:
    """Whether a stored mixed format is one :class:`MixedBlockLinear` holds: at most ``MAX_PARTS`` parts, each in
    a block format of :data:`BLOCK_FORMATS` whose block divides the input size."""
    parts = mixed_parts(fmt)
    return 1 <= len(parts) <= kernels.MAX_PARTS and all(
        part in BLOCK_FORMATS and not in_features % kernels.BLOCK_FORMATS[part][0] for part, _ in parts)


def linear_bytes(fmt: str, out_features: int, in_features: int, *, bias: bool) -> int:
    """Bytes one projection takes in ``fmt``: its weights (int8: plus a float32 scale per output
    channel; a :func:`mixed_format`: each part's blocks) and a float32 bias when there is one."""
    bias_bytes = 4 * out_features if bias else 0
    parts = mixed_parts(fmt)
    if parts:
        if sum(rows for _, rows in parts) != out_features:
            raise ValueError(f"fmt: {fmt!r} holds {sum(rows for _, rows in parts)} rows, the layer {out_features}")
        return sum(linear_bytes(part, rows, in_features, bias=False) for part, rows in parts) + bias_bytes
    if fmt in BLOCK_FORMATS:
        per_block, block_bytes = kernels.BLOCK_FORMATS[fmt]
        return out_features * (-(-in_features // per_block)) * block_bytes + bias_bytes
    if fmt == "int8":
        return out_features * in_features + 4 * out_features + bias_bytes
    return {"float32": 4, "float16": 2}[fmt] * out_features * in_features + bias_bytes


def int8_linear_bytes(out_features: int, in_features: int, *, bias: bool) -> int:
    """Bytes of one :class:`Int8DynamicLinear`."""
    return linear_bytes("int8", out_features, in_features, bias=bias)


class StoredProjection(Protocol):
    """One projection's weights as a checkpoint stores them (what a ``source`` of :func:`apply_weight_format`
    gives for a layer name): the GGUF loader's, read from the memory-mapped file when asked."""

    #: the stored format of all its rows: a block format, "float32"/"float16"/"bfloat16", or a :func:`mixed_format`
    format: str

    def blocks(self) -> torch.Tensor:
        """ggml blocks uint8 [out, in / per block * bytes] (only when ``format`` is a block format)."""
        ...

    def part_blocks(self, part: int) -> torch.Tensor:
        """Part ``part``'s ggml blocks uint8 [its rows, in / per block * bytes] (only when ``format`` is a
        :func:`mixed_format`, each part in a block format)."""
        ...

    def floats(self) -> torch.Tensor:
        """The weights as float32 [out, in], made one tensor at a time."""
        ...

    def bias(self) -> torch.Tensor | None:
        """The float32 bias [out], or None."""
        ...

    def release(self) -> None:
        """The layer is built: what the source holds for it may go."""
        ...


#: A layer's name ("layers.0.attn.qkv_proj", "lm_head") -> its weights where the checkpoint stores them.
WeightSource = Callable[[str], StoredProjection]


@dataclass(frozen=True)
class WeightFormat:
    """A weight format as the engine applies it: ``method`` (a value of ``quantization``), the layer names
    kept in float32 (``skip``), whether float32 projections are packed for oneDNN (``pack``) and how the block
    formats round a step's activations (``activation_dtype``, :attr:`BlockLinear.activation_dtype`)."""

    method: str | None
    skip: tuple[str, ...] = ()
    pack: bool = False
    activation_dtype: str = "int16"


def apply_weight_format(model: nn.Module, method: str | None, skip: Iterable[str] = (), *, pack: bool = False,
                        source: WeightSource | None = None, activation_dtype: str = "int16") -> int:
    """Put ``model``'s projections (every ``nn.Linear`` and the LM head) in ``method``'s CPU format, in place.

    ``skip``: substrings of layer names kept in float32. ``pack``: float32 projections left (all of
    them for ``method=None``, the skipped ones otherwise) are packed for oneDNN, except a head tied
    to the embedding (the embedding stays for lookups; a packed copy would double it). Returns the
    bytes the replaced layers take (:func:`weight_bytes` counts the same from the config alone).

    ``source``: where each replaced layer's weights come from (by layer name) instead of the model's own
    parameters, which may then be on the meta device: the GGUF loader's, so that a layer in the format
    its file stores it in is built from those blocks (:meth:`BlockLinear.from_blocks`) and any other from
    its float32 values, one layer at a time. A layer already replaced (a model formatted at load) is left.
    With a source, the token embedding (the family's ``nn.Embedding``) becomes a :class:`BlockEmbedding` of the
    file's blocks where :func:`embedding_formats` says so (after the head: a tied head built from the same blocks
    is read, not copied); its bytes are in the count. Without one (a float model) it stays a float table: it has
    no blocks to keep.

    ``activation_dtype``: every block-format layer's :attr:`BlockLinear.activation_dtype` (ValueError for another value
    than ``"int16"`` / ``"int8"``, before any layer is built).

    The one place a loaded model's modules are replaced: each ``nn.Linear`` in a format becomes that
    format's :class:`FormatLinear` on its parent (the same attribute), the embedding a :class:`BlockEmbedding`
    on its parent, and the output projection is handed to the model's own ``use_output_proj`` (part of the
    model family contract, see :mod:`asyncinfer.models.registry`).
    """
    skip = tuple(skip)
    kernels.activation_dtype_flag(activation_dtype)  # a bad value named before any layer is built
    stored = dict(model.config.stored_formats)
    # The embeddings a file keeps in its blocks (decided while the model is whole: a tied head reads its table).
    embeddings = [] if source is None else _block_embeddings(model, method, skip)
    jobs: list[tuple[nn.Module | None, str, str, str, torch.Tensor, torch.Tensor | None]] = []
    for parent, name, full, linear in _format_linears(model):
        fmt = _layer_format(method, full, skip, linear.in_features, stored.get(full))
        if fmt != "float32" or pack:
            jobs.append((parent, name, full, fmt, linear.weight, linear.bias))
    if model.output_proj is None:
        head_fmt = _head_format(model, method, skip, stored.get("lm_head"))
        tied = model.config.tie_word_embeddings
        if head_fmt != "float32" or (pack and not tied):
            jobs.append((None, "output_proj", "lm_head", head_fmt, model.lm_head_weight, None))

    def build(job: tuple[nn.Module | None, str, str, str, torch.Tensor, torch.Tensor | None]) -> FormatLinear:
        _, _, full, fmt, weight, bias = job
        kernel = "rows" if full == "lm_head" else "tile"  # a row per sampled request, or every token of a prefill
        try:
            if source is not None:
                return _from_source(fmt, source(full), activation_dtype, kernel)
            if mixed_parts(fmt):
                return _mixed_from_floats(fmt, weight, bias, activation_dtype, kernel)
            if fmt in BLOCK_FORMATS:
                return block_layer_class(fmt)(weight, bias, activation_dtype=activation_dtype, int8_kernel=kernel)
            return _layer_class(fmt)(weight, bias)
        except ValueError as exc:  # weights the format cannot hold (a NaN or an inf; past float16's range)
            raise ModelLoadError(f"{full}.weight cannot be quantized to {fmt}: {exc}") from None

    # The kernels' packing runs single-threaded and outside the GIL: one layer per core at load
    # (fbgemm's float16 packing of SmolLM2-135M: 1.8 s alone, 1.2 s on two cores).
    workers = max(1, min(len(jobs), torch.get_num_threads(), 8))
    with ThreadPoolExecutor(workers, thread_name_prefix="asyncinfer-pack") as pool:
        layers = list(pool.map(build, jobs))
    nbytes = 0
    for (parent, name, _, _, _, _), layer in zip(jobs, layers):
        if parent is None:
            model.use_output_proj(layer)  # the family's own method: a tied embedding stays float for lookups
        else:
            setattr(parent, name, layer)  # the swap: a projection becomes its format's layer, in place
        nbytes += layer.nbytes
    for plan in embeddings:  # after the head: a tied one's blocks are read, not copied
        assert source is not None
        embedding = _embedding_from_source(plan.fmt, source(plan.name), model.output_proj if plan.shares_head else None)
        setattr(plan.parent, plan.attribute, embedding)  # the float table is never made
        nbytes += embedding.nbytes
    return nbytes


def _embedding_from_source(fmt: str, stored: StoredProjection, head: nn.Module | None) -> BlockEmbedding:
    """The :class:`BlockEmbedding` of a file's embedding stored in ``fmt``: ``head``'s blocks where it is a tied
    head built from those same blocks (one copy), else the file's blocks as they lie (no copy); the source is
    released either way."""
    try:
        if isinstance(head, BlockLinear) and head.fmt == fmt and head.lossless and not head.lanes:
            return BlockEmbedding(kernels.BlockTable(head.kernel_weights()[1], fmt, packed=True), shared=True)
        if stored.format != fmt:
            raise ValueError(f"fmt: the embedding is stored as {stored.format!r}, not {fmt!r}")
        return BlockEmbedding(kernels.BlockTable(stored.blocks(), fmt))
    finally:
        stored.release()


def _from_source(fmt: str, stored: StoredProjection, activation_dtype: str = "int16",
                 int8_kernel: str = "tile") -> FormatLinear:
    """``fmt``'s layer from a checkpoint's weights: from its blocks where the file stores them in ``fmt`` (a
    :class:`MixedBlockLinear` from each part's blocks for a :func:`mixed_format`), else from their float32 values;
    the source is released either way."""
    try:
        if fmt == stored.format and fmt in BLOCK_FORMATS:
            return block_layer_class(fmt).from_blocks(stored.blocks(), stored.bias(), activation_dtype=activation_dtype,
                                                      int8_kernel=int8_kernel)
        parts = mixed_parts(fmt)
        if parts:
            if fmt != stored.format:
                raise ValueError(f"fmt: a mixed format is built only from a file storing it, here {stored.format!r}")
            bias = stored.bias()
            biases = [None] * len(parts) if bias is None else list(bias.split([rows for _, rows in parts]))
            # one part at a time: each part's blocks are read from the file and repacked, never through float32
            return MixedBlockLinear(block_layer_class(part).from_blocks(stored.part_blocks(i), biases[i],
                                                                        activation_dtype=activation_dtype,
                                                                        int8_kernel=int8_kernel)
                                    for i, (part, _) in enumerate(parts))
        if fmt in BLOCK_FORMATS:
            return block_layer_class(fmt)(stored.floats(), stored.bias(), activation_dtype=activation_dtype,
                                          int8_kernel=int8_kernel)
        return _layer_class(fmt)(stored.floats(), stored.bias())
    finally:
        stored.release()


def _mixed_from_floats(fmt: str, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation_dtype: str = "int16", int8_kernel: str = "tile") -> MixedBlockLinear:
    """A :func:`mixed_format`'s layer from float weights [out, in]: each part's rows in its own block format."""
    rows = [n for _, n in mixed_parts(fmt)]
    biases = [None] * len(rows) if bias is None else list(bias.detach().split(rows))
    return MixedBlockLinear(block_layer_class(part)(w, b, activation_dtype=activation_dtype, int8_kernel=int8_kernel)
                            for (part, _), w, b in zip(mixed_parts(fmt), weight.detach().split(rows), biases))


def _layer_class(fmt: str) -> type[FormatLinear]:
    return block_layer_class(fmt) if fmt in BLOCK_FORMATS else _LAYERS[fmt]


@functools.cache
def block_layer_class(fmt: str) -> type[BlockLinear]:
    """The layer class of a block format of :data:`asyncinfer.kernels.formats.LAYOUTS`: its own subclass
    (:class:`Q4_1Linear`, ...), or for a format the kernels take that has none, a :class:`BlockLinear`
    subclass made once for it."""
    cls = _LAYERS.get(fmt)
    if isinstance(cls, type) and issubclass(cls, BlockLinear):
        return cls
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; expected one of {list(BLOCK_FORMATS)}")
    return type(f"{fmt.upper()}Linear", (BlockLinear,), {"fmt": fmt, "__doc__": f"ggml's {fmt.upper()} blocks."})


def layer_formats(model_config: ModelConfig, method: str | None, skip: Iterable[str] = ()) -> dict[str, str]:
    """Each projection's format under ``method`` (layer name -> format, ``"lm_head"`` included), as
    :func:`apply_weight_format` and :func:`weight_bytes` decide it from the config alone; "float32" for a layer
    left in float32."""
    return _layer_formats(build_on_meta(model_config), method, tuple(skip))


def _layer_formats(model: nn.Module, method: str | None, skip: tuple[str, ...]) -> dict[str, str]:
    stored = dict(model.config.stored_formats)
    formats = {full: _layer_format(method, full, skip, linear.in_features, stored.get(full))
               for _, _, full, linear in _format_linears(model)}
    formats["lm_head"] = _head_format(model, method, skip, stored.get("lm_head"))
    return formats


@dataclass(frozen=True)
class _EmbeddingPlan:
    """A token embedding kept in its file's blocks: where it is (``parent.attribute``, layer ``name``), its shape,
    its format and whether it reads the head's blocks (tied, and the head built from the same blocks)."""

    parent: nn.Module
    attribute: str
    name: str
    shape: tuple[int, int]
    fmt: str
    shares_head: bool


def _embeddings(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Embedding]]:
    """``(parent, attribute, full name, layer)`` of every ``nn.Embedding`` (a family's token embedding)."""
    return [(module, child_name, f"{name}.{child_name}" if name else child_name, child)
            for name, module in model.named_modules() for child_name, child in module.named_children()
            if isinstance(child, nn.Embedding)]


def _block_embeddings(model: nn.Module, method: str | None, skip: tuple[str, ...]) -> list[_EmbeddingPlan]:
    """The embeddings of ``model`` (its float layers as built, on meta or loaded) that a load from its file keeps
    in the file's blocks under ``method`` (see :func:`embedding_formats`)."""
    if method is None or (method not in BLOCK_FORMATS and method != NATIVE):
        return []  # the float formats keep float tables (and the CUDA dtypes)
    stored = dict(model.config.stored_formats)
    plans = []
    for parent, attribute, name, embedding in _embeddings(model):
        fmt = stored.get(name)
        if fmt not in BLOCK_FORMATS or any(s in name for s in skip) or (
                embedding.weight.shape[1] % kernels.BLOCK_FORMATS[fmt][0]):
            continue
        head = _head_format(model, method, skip, stored.get("lm_head")) if model.config.tie_word_embeddings else None
        if head == "float32":
            continue  # the table is the head too: it stays float
        plans.append(_EmbeddingPlan(parent, attribute, name, tuple(embedding.weight.shape), fmt, head == fmt))
    return plans


def embedding_formats(model_config: ModelConfig, method: str | None, skip: Iterable[str] = ()) -> dict[str, str]:
    """Each token embedding's format when a GGUF file is loaded in ``method`` (layer name, e.g. ``"embed_tokens"``
    -> format), as :func:`apply_weight_format` with the file as ``source`` and :func:`weight_bytes` decide it from
    the config alone: the block format the file stores it in (``ModelConfig.stored_formats``) under a block format
    or ``"native"`` where that is a format of :data:`asyncinfer.kernels.formats.LAYOUTS`, unless it is skipped or
    is a tied head's table that the head leaves in float32 (then it is that head); else "float32" (the float
    table, as a Hugging Face checkpoint, the float formats and ``None`` keep it)."""
    model = build_on_meta(model_config)
    kept = {plan.name: plan.fmt for plan in _block_embeddings(model, method, tuple(skip))}
    return {name: kept.get(name, "float32") for _, _, name, _ in _embeddings(model)}


def quantize_int8(model: nn.Module, skip: Iterable[str] = ()) -> int:
    """:func:`apply_weight_format` with ``"int8"`` and no packing of the layers left in float32."""
    return apply_weight_format(model, "int8", skip)


def weight_bytes(
    model_config: ModelConfig,
    dtype_bytes: int,
    quantization: str | None = None,
    skip: Iterable[str] = (),
    device: torch.device | str = "cpu",
) -> int:
    """Bytes the model's weights take once loaded in a ``dtype_bytes`` dtype, in a weight format, from its config alone.

    The one weight-size calculation: the memory planner (before loading) and the start-up path
    (after loading) both use it. Nothing is loaded: the family's model is built on the meta device
    and its layers are counted as :func:`apply_weight_format` leaves them on ``device``'s type (on
    CUDA the formats are dtypes: nothing is replaced), a GGUF file's as the engine loads it, the file
    as the source: its embedding in the file's blocks where :func:`embedding_formats` says so (none
    of its own where it reads a tied head's). Packing float32 weights changes no size.

    Raises:
        InvalidParameterError: ``quantization`` is not None or one of ``QUANTIZATION_METHODS``.
        ModelLoadError: the config's architecture is not registered.
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise InvalidParameterError("quantization", quantization, f"None or one of {list(QUANTIZATION_METHODS)}")
    model = build_on_meta(model_config)
    total = _float_bytes(model, dtype_bytes)
    if quantization is None or torch.device(device).type == "cuda":
        return total
    skip = tuple(skip)
    stored = dict(model_config.stored_formats)
    for _, _, full, linear in _format_linears(model):
        fmt = _layer_format(quantization, full, skip, linear.in_features, stored.get(full))
        if fmt != "float32":
            total += linear_bytes(fmt, *linear.weight.shape, bias=linear.bias is not None)
            total -= _float_bytes(linear, dtype_bytes)
    head = _head_format(model, quantization, skip, stored.get("lm_head"))
    if head != "float32":
        total += linear_bytes(head, *model.lm_head_weight.shape, bias=False)
        if not model_config.tie_word_embeddings:  # the float head is dropped; a tied one is the embedding
            total -= model.lm_head_weight.numel() * dtype_bytes
    for plan in _block_embeddings(model, quantization, skip):  # no float table: the file's blocks instead
        total -= plan.shape[0] * plan.shape[1] * dtype_bytes
        total += 0 if plan.shares_head else linear_bytes(plan.fmt, *plan.shape, bias=False)
    return total


def decode_weight_bytes(
    model_config: ModelConfig,
    dtype_bytes: int,
    quantization: str | None = None,
    skip: Iterable[str] = (),
    device: torch.device | str = "cpu",
) -> int:
    """Bytes of weights one decode step reads: :func:`weight_bytes` less the token embedding table
    ([vocab, hidden] in the dtype, or in its file's blocks: :func:`embedding_formats`), of which a step
    gathers only its tokens' rows, unless that table is itself the LM head (tied embeddings with the head
    in the dtype, or a block embedding reading the head's own blocks), which every step reads whole. A
    tied head in a weight format of its own is a matrix apart from the table (float, or the file's blocks,
    for the rows), and an untied model's head is another matrix: the table is not read.
    The roofline gauge's weights (``asyncinfer.metrics``).
    """
    total = weight_bytes(model_config, dtype_bytes, quantization, skip, device)
    table = model_config.vocab_size * model_config.hidden_size * dtype_bytes
    if quantization is None or torch.device(device).type == "cuda":
        return total if model_config.tie_word_embeddings else total - table  # tied: the head is the table
    skip = tuple(skip)
    model = build_on_meta(model_config)
    blocks = _block_embeddings(model, quantization, skip)
    if blocks:  # one embedding a family: its own blocks are not read, the head's are (as the head)
        return total - sum(0 if plan.shares_head else linear_bytes(plan.fmt, *plan.shape, bias=False)
                           for plan in blocks)
    if not model_config.tie_word_embeddings:
        return total - table
    head = _head_format(model, quantization, skip, dict(model_config.stored_formats).get("lm_head"))
    return total if head == "float32" else total - table


def _float_bytes(module: nn.Module, dtype_bytes: int) -> int:
    return sum(p.numel() for p in module.parameters()) * dtype_bytes


def _format_linears(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """``(parent, attribute, full name, layer)`` of every ``nn.Linear`` but the LM head (:func:`_head_format`'s)."""
    found = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child_name != "lm_head" and isinstance(child, nn.Linear):
                found.append((module, child_name, f"{name}.{child_name}" if name else child_name, child))
    return found


def _layer_format(method: str | None, name: str, skip: tuple[str, ...], in_features: int,
                  stored: str | None = None) -> str:
    """A projection's format: ``method`` (for "native", ``stored``, the format its file stores it in, where a
    kernel takes it, else :func:`native_fallback`; for a k-quant whose 256 does not divide the input size, its
    :data:`K_QUANT_FALLBACK`), or float32 when skipped (or for a block format, when its input size is not a
    whole number of blocks). A :func:`mixed_format` stored with every part in a block format (input sizes whole
    blocks, at most ``MAX_PARTS`` parts) stays that mixed format under "native" (a :class:`MixedBlockLinear`)."""
    if method is None or any(s in name for s in skip):
        return "float32"
    fmt = method
    if method == NATIVE:
        if stored is not None and mixed_parts(stored):
            return stored if _kernel_mixed(stored, in_features) else native_fallback()
        fmt = stored if stored in BLOCK_FORMATS else native_fallback()
    elif method in K_QUANT_FALLBACK and in_features % kernels.BLOCK_FORMATS[method][0]:
        fmt = K_QUANT_FALLBACK[method]
    if fmt in BLOCK_FORMATS and in_features % kernels.BLOCK_FORMATS[fmt][0]:
        return "float32"
    return fmt


def native_fallback() -> str:
    """The format of a projection that ``"native"`` cannot keep in its file's own: float16 where fbgemm runs,
    else float32."""
    return "float16" if fp16_weights_available() else "float32"


def _head_format(model: nn.Module, method: str | None, skip: tuple[str, ...], stored: str | None = None) -> str:
    """The output projection's format (every family has one, ``lm_head_weight``): ``method`` (a block
    format's head format; for "native" the head's stored format as for any layer), or float32 when skipped."""
    skip = tuple(s for s in skip if s)
    if method == NATIVE:
        return _layer_format(method, "lm_head", skip, model.lm_head_weight.shape[1], stored)
    head = BLOCK_HEAD_FORMAT.get(method, method)  # type: ignore[arg-type]
    return _layer_format(head, "lm_head", skip, model.lm_head_weight.shape[1])
