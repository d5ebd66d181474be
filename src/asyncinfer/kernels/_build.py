"""Building, loading and finding asyncinfer's compiled kernels: the one place that knows where the library
comes from and whether it can run here (:func:`available`, :func:`unavailable_reason`, :func:`lib`)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from asyncinfer.kernels.formats import BLOCK_FORMATS

_SOURCE = Path(__file__).with_name("gguf_gemm.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_VERSION = 23
#: From this many activation rows on, the GEMM takes its float32 panel path (the C source's PANEL_MIN_ROWS).
PANEL_MIN_ROWS = 5

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
        if lib.asyncinfer_panel_min_rows() != PANEL_MIN_ROWS:
            _reason = "the built library disagrees with PANEL_MIN_ROWS"
            return
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


def lib() -> ctypes.CDLL:
    """The loaded library (built on the first call); RuntimeError naming why where the kernels cannot run."""
    if _lib is not None:
        return _lib
    _load()
    if _lib is None:
        raise RuntimeError(f"asyncinfer's kernels cannot run here: {_reason}")
    return _lib



def loaded() -> bool:
    """Whether the kernels are already built and loaded in this process (never builds them, unlike
    :func:`available`): for callers that use them only when something else has (the sampler)."""
    return _lib is not None

