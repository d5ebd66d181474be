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

import ctypes
import hashlib
import operator
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import NamedTuple

import torch

#: Block formats: (weights per block, bytes per block).
BLOCK_FORMATS = {"q4_1": (32, 20), "q8_0": (32, 34)}
QK = 32
#: From this many activation rows on, :func:`gemm` rebuilds the weights in float32 and multiplies float32
#: activations (exact products, summed in float32); below it, activations are rounded per block of 32 to
#: int16 (the cheaper path for decode at small batches). Either way a row's result does not depend on
#: the other rows of the call, only on which side of this count the call falls.
PANEL_MIN_ROWS = 5

_SOURCE = Path(__file__).with_name("gguf_gemm.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_VERSION = 23

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False


def _cache_dir() -> Path:
    override = os.environ.get("ASYNCINFER_KERNEL_CACHE")
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("asyncinfer")) / "kernels"


def _cpu_reason() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"they are built for x86-64 Linux, not {platform.system()} {platform.machine()}"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo ({exc})"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _torch_openmp() -> str | None:
    """The OpenMP runtime torch has loaded (its wheels ship their own libgomp, sometimes renamed): the
    kernels link against that very file, so that the process keeps one runtime and one thread pool."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line and line.split()[-1].startswith("/")}
    return min(paths) if paths else None


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    openmp = _torch_openmp()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + version.encode() + str(openmp).encode()).hexdigest()
    target = _cache_dir() / f"gguf_gemm-{key[:16]}.so"
    if target.exists() and _digest_ok(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / "gguf_gemm.o", Path(tmp) / target.name
        compile_flags = [f for f in _FLAGS if f != "-shared"]
        steps = [[compiler, *compile_flags, "-c", str(_SOURCE), "-o", str(obj)]]
        if openmp:  # link to torch's runtime by its path (and soname), not to another copy
            steps.append([compiler, "-shared", str(obj), openmp, f"-Wl,-rpath,{Path(openmp).parent}", "-o", str(out)])
        else:
            steps.append([compiler, "-shared", "-fopenmp", str(obj), "-o", str(out)])
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        digest = hashlib.sha256(out.read_bytes()).hexdigest()
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same bytes
        sidecar = Path(tmp) / "digest"
        sidecar.write_text(digest)
        os.replace(sidecar, _digest_path(target))
    return target


def _digest_path(build: Path) -> Path:
    return build.with_suffix(".sha256")


def _digest_ok(build: Path) -> bool:
    """Whether a cached build is the file its build wrote (a truncated one would crash the process in
    dlopen, before Python could catch anything)."""
    try:
        return hashlib.sha256(build.read_bytes()).hexdigest() == _digest_path(build).read_text().strip()
    except OSError:
        return False


def _open(path: Path, compiler: str) -> ctypes.CDLL:
    """Load a build; one that cannot be loaded (a truncated or stale file in the cache) is rebuilt once.
    torch is imported (and its OpenMP runtime loaded) first: the kernels share that runtime."""
    for attempt in range(2):
        try:
            lib = ctypes.CDLL(str(path))
            if lib.asyncinfer_kernels_version() != _VERSION:
                raise RuntimeError("a stale build (version mismatch)")
            return lib
        except (OSError, RuntimeError, AttributeError):
            if attempt:
                raise
            path.unlink(missing_ok=True)
            _digest_path(path).unlink(missing_ok=True)
            path = _build(compiler)
    raise AssertionError("unreachable")


def _load() -> None:
    global _lib, _reason, _tried
    with _lock:
        if _tried:
            return
        _tried = True
        if os.environ.get("ASYNCINFER_DISABLE_KERNELS", "").strip().lower() not in ("", "0", "false", "no"):
            _reason = "ASYNCINFER_DISABLE_KERNELS is set"
            return
        _reason = _cpu_reason()
        if _reason is not None:
            return
        compiler = _compiler()
        if compiler is None:
            _reason = "no C compiler (cc, gcc or clang) is on PATH to build them"
            return
        try:
            lib = _open(_build(compiler), compiler)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            _reason = f"building them failed: {exc}"
            return
        args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        for fmt in BLOCK_FORMATS:
            fn = getattr(lib, f"asyncinfer_gemm_{fmt}")
            fn.argtypes = args
            fn.restype = None
        lib.asyncinfer_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        lib.asyncinfer_rms_norm.restype = None
        lib.asyncinfer_decode_attention.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
            ctypes.c_void_p, ctypes.c_int]
        lib.asyncinfer_decode_attention.restype = None
        P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.asyncinfer_decode_layer.argtypes = [P, P, I64, P, P, P, P, P, P, I64, P, I64, INT, P]
        lib.asyncinfer_decode_layer.restype = INT
        lib.asyncinfer_decode_stack.argtypes = [P, I64, P, P, I64, P, P, I64, P, P, P, I64, P, F32, P, P, INT, I64, P,
                                                P, P, P, I64, P, I64, I64, INT, P]
        lib.asyncinfer_decode_stack.restype = INT
        lib.asyncinfer_argmax.argtypes = [P, I64, I64, I64, P]
        lib.asyncinfer_argmax.restype = None
        lib.asyncinfer_check_paged.argtypes = [P, I64, P, P, I64, I64, I64]
        lib.asyncinfer_check_paged.restype = INT
        global PANEL_MIN_ROWS
        PANEL_MIN_ROWS = lib.asyncinfer_panel_min_rows()
        lib.asyncinfer_scratch_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
        lib.asyncinfer_scratch_bytes.restype = ctypes.c_int64
        _lib = lib


def available() -> bool:
    """Whether the kernels run here (builds them on the first call, ~1 s)."""
    _load()
    return _lib is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    _load()
    return _reason


def _need() -> ctypes.CDLL:
    _load()
    if _lib is None:
        raise RuntimeError(f"asyncinfer's kernels cannot run here: {_reason}")
    return _lib


def gemm(x: torch.Tensor, packed: torch.Tensor, fmt: str, out_features: int,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for float32 x [M, K] and W [out_features, K] held as ``fmt`` blocks in the
    kernels' layout: ``packed = pack(quantize(W, fmt), fmt)`` (uint8 [out_features, K / 32 * bytes per
    block]; ggml's own block order, as :func:`quantize` returns it, has the same shape but is not this
    layout); returns float32 [M, out_features].

    Activations: rounded per block of 32 to int16 below :data:`PANEL_MIN_ROWS` rows, float32 from it on.
    Runs on torch's intra-op thread count. Raises RuntimeError where the kernels cannot run.
    """
    lib = _lib if _lib is not None else _need()
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


def _bytes_per_block(fmt: str) -> int:
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; expected one of {list(BLOCK_FORMATS)}")
    return BLOCK_FORMATS[fmt][1]


def _check_blocks(packed: torch.Tensor, fmt: str, out_features: int, k: int) -> None:
    size = _bytes_per_block(fmt)
    if (packed.dtype == torch.uint8 and packed.dim() == 2 and packed.shape[0] == out_features and packed.shape[1]
            and packed.shape[1] % size == 0 and packed.shape[1] // size * QK != k):
        raise ValueError(f"x has {k} columns, but the {fmt} weights hold {packed.shape[1] // size * QK} inputs "
                         f"per row")
    expected = (out_features, k // QK * size)
    if k % QK or packed.dtype != torch.uint8 or tuple(packed.shape) != expected or not packed.is_contiguous():
        raise ValueError(f"{fmt} weights for {k} inputs and {out_features} outputs are contiguous uint8 {expected} "
                         f"(the input size a multiple of {QK}), got {packed.dtype} {tuple(packed.shape)}")


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 weights [N, K] (K a multiple of 32) -> ``fmt`` blocks, uint8 [N, K / 32 * bytes per block].

    Q4_1: per block, m = min, d = (max - min) / 15, q = round((w - m) / d) in [0, 15];
    Q8_0: d = max |w| / 127, q = round(w / d). d and m are stored in float16, and q is computed
    against the stored values.
    """
    _bytes_per_block(fmt)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize takes floating-point weights [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"{fmt} needs an input size that is a multiple of {QK}, got {k}")
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
    return blocks.reshape(n, -1).contiguous()


def _block_bytes(blocks: torch.Tensor, fmt: str, what: str) -> int:
    """Bytes per block of ``fmt``, once ``blocks`` is checked to be uint8 [N, B * bytes]."""
    size = _bytes_per_block(fmt)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"{what} takes {fmt} blocks as uint8 [N, a multiple of {size} bytes], got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    return size


def pack(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """ggml blocks uint8 [N, B * bytes] -> the kernels' layout (same size): per row, every block's
    float16 scale ``d``, then (Q4_1) every minimum ``m``, then the quants of block after block."""
    size = _block_bytes(blocks, fmt, "pack")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, size)  # [N, B, bytes]
    head = 4 if fmt == "q4_1" else 2
    parts = [b[..., 0:2].reshape(n, -1)]  # d of every block
    if fmt == "q4_1":
        parts.append(b[..., 2:4].reshape(n, -1))  # m of every block
    parts.append(b[..., head:].reshape(n, -1))
    return torch.cat(parts, dim=1).contiguous()


def unpack(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernels' layout back to ggml blocks (the inverse of :func:`pack`)."""
    size = _block_bytes(packed, fmt, "unpack")
    n = packed.shape[0]
    nb = packed.shape[1] // size
    d = packed[:, : 2 * nb].reshape(n, nb, 2)
    if fmt == "q4_1":
        parts = [d, packed[:, 2 * nb : 4 * nb].reshape(n, nb, 2), packed[:, 4 * nb :].reshape(n, nb, 16)]
    else:
        parts = [d, packed[:, 2 * nb :].reshape(n, nb, 32)]
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fmt`` blocks uint8 [N, B * bytes] -> float32 [N, B * 32], as ggml (and the kernels) rebuild them."""
    size = _block_bytes(blocks, fmt, "dequantize")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, size)  # [N, B, bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, B, 1]
    if fmt == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # [N, B, 32]
        return torch.addcmul(m, d, q).reshape(n, -1)  # d * q + m, exact in float32
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(n, -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of float32 x [..., hidden] scaled by ``weight``, the same shape back: the float32 steps
    of :func:`asyncinfer.models.layers.rms_norm`, summed in another order (equal within float32 rounding)."""
    lib = _lib if _lib is not None else _need()
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
    lib = _lib if _lib is not None else _need()
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


_FORMAT_CODES = {"q4_1": 0, "q8_0": 1}


class _Layer(ctypes.Structure):
    """``layer_t`` in gguf_gemm.c: one layer's weights (raw pointers) and shape."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("w_qkv", ctypes.c_void_p),
                ("b_qkv", ctypes.c_void_p), ("w_o", ctypes.c_void_p), ("w_gate_up", ctypes.c_void_p),
                ("w_down", ctypes.c_void_p), ("fmt_qkv", ctypes.c_int32), ("fmt_o", ctypes.c_int32),
                ("fmt_gate_up", ctypes.c_int32), ("fmt_down", ctypes.c_int32), ("hidden", ctypes.c_int64),
                ("H", ctypes.c_int64), ("KVH", ctypes.c_int64), ("D", ctypes.c_int64), ("I", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


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


class DecodeLayer:
    """One Llama-family decoder layer for a step of decodes, in a single kernel call
    (``asyncinfer_decode_layer``): norms, projections, rope, the K/V write, attention over the paged
    cache and SwiGLU, each the same computation as the engine's kernels run op by op.

    Built once per layer from its weights (held here, so they outlive nothing); called per step with
    the residual stream ``h`` [T, hidden] (float32, contiguous, updated in place and returned).
    ``qkv``, ``o``, ``gate_up``, ``down``: each ``(format, blocks, bias or None)``, blocks as
    :func:`gemm` takes them (``pack(quantize(w, format), format)``; ``qkv`` the q, k and v rows one
    after another, ``gate_up`` the gate rows then the up rows); norms float32 [hidden].
    """

    def __init__(self, *, norm1: torch.Tensor, norm2: torch.Tensor, eps: float, qkv: tuple, o: tuple,
                 gate_up: tuple, down: tuple, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, scale: float) -> None:
        # qkv / o / gate_up / down: (format, blocks, bias or None).
        self._args = {"norm1": norm1, "norm2": norm2, "eps": eps, "qkv": qkv, "o": o, "gate_up": gate_up,
                      "down": down, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                      "intermediate_size": intermediate_size, "scale": scale}
        self._hidden = norm1.shape[0]
        self._struct = _Layer(
            norm1.data_ptr(), norm2.data_ptr(), qkv[1].data_ptr(), None if qkv[2] is None else qkv[2].data_ptr(),
            o[1].data_ptr(), gate_up[1].data_ptr(), down[1].data_ptr(), _FORMAT_CODES[qkv[0]], _FORMAT_CODES[o[0]],
            _FORMAT_CODES[gate_up[0]], _FORMAT_CODES[down[0]], self._hidden, num_heads, num_kv_heads, head_dim,
            intermediate_size, eps, scale)
        #: None, or float64 [3] that each call adds its seconds to: projections, attention, the whole
        #: layer (set by a profiler, e.g. ``benchmarks/throughput.py --profile``; see :meth:`time_parts`).
        self.timing: torch.Tensor | None = None

    def time_parts(self, on: bool = True) -> None:
        """Start (zeroed) or stop adding up where this layer's calls spend their time."""
        self.timing = torch.zeros(3, dtype=torch.float64) if on else None

    def __deepcopy__(self, memo: dict) -> DecodeLayer:
        # The raw pointers must follow the copied tensors (the same copies the copied layers hold).
        import copy

        return DecodeLayer(**copy.deepcopy(self._args, memo))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of this layer: h float32 [T, hidden]; cos/sin float32 [T, (1,) head_dim / 2],
        the rope rows of each token's position; caches float32 [blocks, block_size, KV heads, head_dim];
        slots / context_lens int64 [T]; block_tables int64 [T, n]. Returns h, updated in place.

        Raises TypeError / ValueError for tensors of the wrong type or shape, IndexError for a context,
        slot or block outside the caches."""
        lib = _lib if _lib is not None else _need()
        num_tokens = h.shape[0] if h.dim() == 2 else -1
        half = self._args["head_dim"] // 2
        kv_shape = (self._args["num_kv_heads"], self._args["head_dim"])
        if h.dtype != torch.float32 or h.dim() != 2 or h.shape[1] != self._hidden:
            raise ValueError(f"h must be float32 [T, {self._hidden}], got {h.dtype} {tuple(h.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != num_tokens * half:
                raise ValueError(f"{name} must be contiguous float32 [{num_tokens}, {half}], got {t.dtype} "
                                 f"{tuple(t.shape)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 4 or tuple(t.shape[2:]) != kv_shape \
                    or t.shape != k_cache.shape:
                raise ValueError(f"{name} must be contiguous float32 [blocks, block_size, {kv_shape[0]}, "
                                 f"{kv_shape[1]}] like k_cache, got {t.dtype} {tuple(t.shape)}")
        _check_timing(self.timing, 3, "DecodeLayer")
        if not h.is_contiguous():
            h = h.contiguous()
        tables = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
        _check_paged(lib, tables, context_lens, slots, k_cache)
        if torch.autograd.profiler._is_profiler_enabled:  # one op per layer in a trace
            with torch.profiler.record_function("asyncinfer::decode_layer"):
                return self._call(lib, h, cos, sin, k_cache, v_cache, slots, tables, context_lens)
        return self._call(lib, h, cos, sin, k_cache, v_cache, slots, tables, context_lens)

    def _call(self, lib: ctypes.CDLL, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor
              ) -> torch.Tensor:
        _check(lib.asyncinfer_decode_layer(
            ctypes.byref(self._struct), h.data_ptr(), h.shape[0], cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], context_lens.data_ptr(),
            k_cache.shape[1], torch.get_num_threads(), None if self.timing is None else self.timing.data_ptr()),
            "decode_layer")
        return h


class _Tables(NamedTuple):
    """A DecodeStack's embedding and rope tables, as last checked: pointers, sizes, whether the kernel
    reads the embedding rows itself (float32, contiguous), and the tensors (their identity)."""

    embed: int
    cos: int
    sin: int
    vocab: int
    positions: int
    kernel_embeds: bool
    embed_tensor: torch.Tensor
    cos_tensor: torch.Tensor


class DecodeStack:
    """Every decoder layer of a model and its final norm, for a step of decodes, in one kernel call
    (``asyncinfer_decode_stack``): the embedding rows, the rope rows for each position, each layer as
    :class:`DecodeLayer` runs it, the final RMS norm and, with a ``head``, the logits. One call per
    step instead of one per layer, and none of torch's per-op cost between them.

    ``layers``: the model's DecodeLayers in order (kept here, with the weights they point to);
    ``final_norm`` / ``eps``: the model's last norm; ``head``: None, or the output projection as
    ``(format, blocks, out_features)`` (blocks as :func:`gemm` takes them).
    """

    def __init__(self, layers: list[DecodeLayer], final_norm: torch.Tensor, eps: float,
                 head: tuple[str, torch.Tensor, int] | None = None) -> None:
        if not layers:
            raise ValueError("DecodeStack needs at least one layer")
        if head is not None:
            fmt, blocks, out_features = head
            _check_blocks(blocks, fmt, out_features, layers[0]._hidden)
        self.layers = list(layers)
        self.head = head
        self._norm = final_norm.detach().float().contiguous()
        self._eps = eps
        self._array = (_Layer * len(self.layers))(*(layer._struct for layer in self.layers))
        # The caches as last checked: their tensors (k0, v0, k1, ...), layer 0's K address, their pointers.
        self._kv: tuple[tuple[torch.Tensor, ...], int, ctypes.Array] | None = None
        self._tables: _Tables | None = None  # the embedding and rope tables, as last checked
        #: None, or float64 [4] that each call adds its seconds to: the layers' projections, attention,
        #: the layers as a whole, and the head (see :meth:`time_parts`).
        self.timing: torch.Tensor | None = None

    def time_parts(self, on: bool = True) -> None:
        """Start (zeroed) or stop adding up where the calls spend their time (all layers together)."""
        self.timing = torch.zeros(4, dtype=torch.float64) if on else None

    def __deepcopy__(self, memo: dict) -> DecodeStack:
        import copy

        return DecodeStack([copy.deepcopy(layer, memo) for layer in self.layers], copy.deepcopy(self._norm, memo),
                           self._eps, copy.deepcopy(self.head, memo))

    def _cache_pointers(self, kv_caches: list) -> ctypes.Array:
        """The caches' pointers, checked and gathered again whenever the list holds other tensors (compared
        by identity, which costs no torch call) or layer 0's cache moved."""
        held = self._kv
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        first = kv_caches[0][0].data_ptr()
        if held is None or held[1] != first or not all(map(operator.is_, chain.from_iterable(kv_caches), held[0])):
            tensors = tuple(chain.from_iterable(kv_caches))
            shape = tensors[0].shape
            for layer, (k, v) in zip(self.layers, kv_caches):
                kv_shape = (layer._args["num_kv_heads"], layer._args["head_dim"])
                if not (k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
                        and k.shape == v.shape == shape and k.dim() == 4 and tuple(k.shape[2:]) == kv_shape):
                    raise TypeError(f"DecodeStack takes contiguous float32 K/V caches [blocks, block_size, "
                                    f"{kv_shape[0]}, {kv_shape[1]}], all of one shape; got {k.dtype} "
                                    f"{tuple(k.shape)} / {v.dtype} {tuple(v.shape)}")
            pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
            held = self._kv = (tensors, first, pointers)
        return held[2]

    def _check_tables(self, embed: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> _Tables:
        """The embedding and rope tables' pointers and sizes, and whether the kernel embeds (float32
        rows); checked when they change."""
        key = (embed.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr())
        held = self._tables
        if held is not None and (held.embed, held.cos, held.sin) == key and held.embed_tensor is embed and (
                held.cos_tensor is cos_table):
            return held
        layer = self.layers[0]
        half = layer._args["head_dim"] // 2
        if embed.dim() != 2 or embed.shape[1] != layer._hidden or embed.device.type != "cpu":
            raise TypeError(f"embed must be a CPU table [vocab, {layer._hidden}], got {tuple(embed.shape)}")
        for name, t in (("cos_table", cos_table), ("sin_table", sin_table)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != half or (
                    t.shape != cos_table.shape):
                raise TypeError(f"{name} must be contiguous float32 [positions, {half}] like cos_table, got "
                                f"{t.dtype} {tuple(t.shape)}")
        held = self._tables = _Tables(*key, embed.shape[0], cos_table.shape[0],
                                      embed.dtype == torch.float32 and embed.is_contiguous(), embed, cos_table)
        return held

    def __call__(self, input_ids: torch.Tensor, embed: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, kv_caches: list, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, logits: bool = False) -> torch.Tensor:
        """Run a step of decodes: int64 input_ids / positions / slots / context_lens [T]; ``embed`` the
        embedding table [vocab, hidden]; cos/sin tables float32 [max_positions, head_dim / 2];
        ``kv_caches`` one (k, v) per layer; block_tables int64 [T, n]. Returns the final-normed hidden
        states, float32 [T, hidden], or with ``logits=True`` (needs a head) the logits [T, out_features].

        Raises TypeError for inputs of another dtype or shape, IndexError for a token id, position,
        context, slot or block outside its table."""
        num_tokens = input_ids.numel()
        for name, t in (("input_ids", input_ids), ("positions", positions), ("slots", slots),
                        ("context_lens", context_lens), ("block_tables", block_tables)):
            if t.dtype != torch.int64 or t.device.type != "cpu" or (
                    name != "block_tables" and (t.dim() != 1 or t.numel() != num_tokens or not t.is_contiguous())):
                raise TypeError(f"{name} must be a CPU int64 tensor, one entry a token (block_tables: one row), got "
                                f"{t.dtype} {tuple(t.shape)}")
        if block_tables.dim() != 2 or block_tables.shape[0] != num_tokens:
            raise TypeError(f"block_tables must be int64 [{num_tokens}, blocks], got {tuple(block_tables.shape)}")
        tables = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
        return self._run(input_ids.shape[0], input_ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                         context_lens.data_ptr(), tables.data_ptr(), tables.shape[1], embed, cos_table, sin_table,
                         kv_caches, logits, lambda: input_ids)

    def decode_packed(self, packed: list[int], num_tokens: int, width: int, embed: torch.Tensor,
                      cos_table: torch.Tensor, sin_table: torch.Tensor, kv_caches: list
                      ) -> tuple[torch.Tensor, list[int]]:
        """The logits [T, out_features] of a step of decodes given as one list of ints (the T token ids,
        the T positions, the T cache slots, the T context lengths, then each sequence's block table
        padded to ``width``: the engine's decode path, one copy from Python and no tensor of its own),
        and each row's argmax (the greedy tokens, as :func:`argmax` picks them) from the same call."""
        if self.head is None:
            raise ValueError("decode_packed needs a DecodeStack built with a head")
        if num_tokens < 1 or width < 1:
            raise ValueError(f"a step of decodes has at least one token and one block, got {num_tokens} and {width}")
        if len(packed) != num_tokens * (4 + width):
            raise ValueError(f"packed holds {len(packed)} ints, not {num_tokens} * (4 + {width})")
        data = (ctypes.c_int64 * (len(packed) + num_tokens))(*packed)  # and room for each row's argmax
        at = ctypes.addressof(data)
        logits = self._run(num_tokens, at, at + 8 * num_tokens, at + 16 * num_tokens, at + 24 * num_tokens,
                           at + 32 * num_tokens, width, embed, cos_table, sin_table, kv_caches, True,
                           lambda: torch.tensor(packed[:num_tokens], dtype=torch.long), at + 8 * len(packed))
        return logits, data[len(packed):]

    def _run(self, num_tokens: int, ids: int, positions: int, slots: int, context_lens: int, tables: int, ldt: int,
             embed: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, kv_caches: list, logits: bool,
             input_ids: Callable[[], torch.Tensor], argmax: int | None = None) -> torch.Tensor:
        lib = _lib if _lib is not None else _need()
        if logits and self.head is None:
            raise ValueError("logits=True needs a DecodeStack built with a head")
        if num_tokens < 1:
            raise ValueError(f"a step of decodes has at least one token, got {num_tokens}")
        timing = self.timing
        _check_timing(timing, 4, "DecodeStack")
        h = None
        tables_in = self._check_tables(embed, cos_table, sin_table)
        if not tables_in.kernel_embeds:  # embedded here instead
            h = torch.nn.functional.embedding(input_ids(), embed).float().contiguous()
            ids = None  # type: ignore[assignment]
        if logits:  # the normed states stay inside the call
            fmt, blocks, head_n = self.head  # type: ignore[misc]
            out, head, result = None, (blocks.data_ptr(), _FORMAT_CODES[fmt], head_n), torch.empty(num_tokens, head_n)
        else:
            out, head, result = torch.empty(num_tokens, self.layers[0]._hidden), (None, 0, 0), None
        pointers = self._cache_pointers(kv_caches)
        cache = self._kv[0][0]  # type: ignore[index]  # layer 0's K [blocks, block size, KV heads, head dim]
        args = (self._array, len(self.layers), pointers, None if h is None else h.data_ptr(),
                num_tokens, ids, tables_in.embed, tables_in.vocab, positions, tables_in.cos, tables_in.sin,
                tables_in.positions,
                self._norm.data_ptr(), self._eps, None if out is None else out.data_ptr(), *head,
                None if result is None else result.data_ptr(), argmax, slots, tables, ldt, context_lens,
                cache.shape[1], cache.shape[0] * cache.shape[1],  # block size, slots
                torch.get_num_threads(), None if timing is None else timing.data_ptr())
        if torch.autograd.profiler._is_profiler_enabled:  # one op per step in a trace
            with torch.profiler.record_function("asyncinfer::decode_stack"):
                code = lib.asyncinfer_decode_stack(*args)
        else:
            code = lib.asyncinfer_decode_stack(*args)
        if code == 1:
            raise IndexError(f"a token id is outside the embedding table [0, {tables_in.vocab})")
        if code == 2:
            raise IndexError(f"a position is outside the rope table [0, {tables_in.positions})")
        _raise_paged(code, ldt, cache)
        _check(code, "decode_stack")
        return out if result is None else result


def loaded() -> bool:
    """Whether the kernels are already built and loaded in this process (never builds them, unlike
    :func:`available`): for callers that use them only when something else has (the sampler)."""
    return _lib is not None


def argmax_takes(x: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes ``x``: a CPU float32 [rows, n > 0] tensor whose rows follow each
    other (values contiguous, rows apart by at least n)."""
    return (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] > 0
            and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1]) and (x.shape[1] == 1 or x.stride(1) == 1))


def argmax(x: torch.Tensor) -> list[int]:
    """Each row's index of its largest value of float32 x [rows, n] (rows may be strided; values
    contiguous), the first among equals and the first NaN if any, as ``torch.argmax`` picks them:
    one vectorised pass, for greedy sampling."""
    lib = _lib if _lib is not None else _need()
    if not argmax_takes(x):
        raise TypeError(f"argmax takes a CPU float32 [rows, n > 0] tensor with contiguous rows, got {x.dtype} "
                        f"{tuple(x.shape)} on {x.device}")
    out = (ctypes.c_int64 * x.shape[0])()
    lib.asyncinfer_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out)
    return list(out)
