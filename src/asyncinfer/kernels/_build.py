"""Finding, building and loading asyncinfer's compiled kernels: the one place that knows where the library
comes from, which ISA variant runs and whether the kernels can run here (:func:`available`,
:func:`unavailable_reason`, :func:`lib`, :func:`isa`, :func:`supported_isas`, :func:`build_info`).

Where a library comes from, in order:

1. **Installed**: ``pip install`` builds one shared library per variant next to this module
   (``_kernels_<isa>.so``, ``setup.py``), compiled with ``-fopenmp`` but not linked to any OpenMP runtime:
   its OpenMP symbols resolve against the runtime torch has loaded (torch loads it for the whole process),
   so the process keeps one runtime and one thread pool. Nothing is compiled at run time.
2. **The run-time build** (a developer's checkout on ``PYTHONPATH``, or an install without a compiler): the
   sources are compiled with the system's C compiler into a private user cache, linked to torch's OpenMP
   runtime by that file's path.

The variant: the best this CPU runs (``asyncinfer_cpu_isas`` of the scalar library, which every machine
has), or the one ``ASYNCINFER_KERNEL_ISA`` names.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from asyncinfer.kernels._variants import (
    BASE_FLAGS,
    ISA_ENV,
    ISA_FLAGS,
    ISAS,
    SOURCES_STAMP,
    compile_order,
    compilers_at_once,
    isas_for,
    library_name,
    sources_digest,
)
from asyncinfer.kernels.formats import BLOCK_FORMATS

_HERE = Path(__file__).parent
_CSRC = _HERE / "csrc"
#: The ABI version this Python side binds (csrc/asyncinfer_kernels.h's ASYNCINFER_KERNELS_VERSION); a
#: library of another version is refused (:func:`_checked`, the one comparison).
_VERSION = 34
#: From this many activation rows on, the GEMM with int16 activations takes its batched path: the int16 tile in
#: the AVX-512 variants, the float32 panel in the others (:func:`int16_batched`); int8 activations are rounded the
#: same way at every count (:func:`gemm`'s ``int8_kernel``; a step's projections: :data:`STEP_TILE_MIN_ROWS`); the C
#: header's ASYNCINFER_PANEL_MIN_ROWS; checked against the loaded library.
PANEL_MIN_ROWS = 9
#: From this many activation rows on, a decoder layer's int8 projection in a plain block format (not a format in
#: lanes, whose own GEMM decides; the output projection too, unless every layer is held in lanes) takes the int8 tile
#: in the AVX-512 variants in the kernels' one-call step (:class:`~asyncinfer.kernels.DecodeLayer`,
#: :class:`~asyncinfer.kernels.DecodeStack`), below it the rows; the C header's ASYNCINFER_STEP_TILE_MIN_ROWS;
#: checked against the loaded library.
STEP_TILE_MIN_ROWS = 12
#: From this many activation rows on, the GEMM with ``activation_dtype="bfloat16"`` rebuilds the weights as
#: bfloat16 (``asyncinfer_dequantize_bf16``, a slice of rows at a time) and multiplies them by torch in bfloat16;
#: below it, int16's rows (a decode step keeps its speed). The panel's own threshold, as measured on an AMX Xeon
#: (one thread over a 1B layer): at 8 rows bfloat16 takes 1.2-1.5x the int16 rows' time, from 9 rows 0.84-0.97x
#: the float32 panel's, which int16 took there before the AVX-512 variants' int16 tile (docs/formats.md,
#: "Batched steps").
BF16_MIN_ROWS = 9
#: The variants whose int16 GEMM keeps int16 activations from PANEL_MIN_ROWS rows on (the int16 tile: each block
#: of 32 rounded and multiplied exactly in integers as below that count, sixteen rows a 512-bit register); the
#: others (scalar, avx2) multiply float32 activations by the weights rebuilt in float32 there (the panel).
INT16_TILE_ISAS = ("avx512", "avx512vnni")
#: The variants that multiply Q4_0 and Q4_1 in lanes (:func:`~asyncinfer.kernels.pack_lanes`) in vector code, 16 rows
#: a 512-bit register; the others (scalar, avx2) run its plain C loop: the same results, written for the tests'
#: comparison and not for speed, so a model's layers take the lanes only where :func:`lanes_native` (docs/formats.md).
LANES_ISAS = ("avx512", "avx512vnni")


class KernelISAError(ValueError):
    """``ASYNCINFER_KERNEL_ISA`` names no variant, or one this CPU cannot run."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_error: KernelISAError | None = None
_tried = False
_info: dict | None = None
_supported: tuple[str, ...] | None = None
#: Whether ASYNCINFER_KERNEL_ISA chose the variant (then quantization="auto" takes the block formats even on scalar).
_forced = False
_variants: dict[str, tuple[ctypes.CDLL, dict]] = {}


def _cache_dir() -> Path:
    override = os.environ.get("ASYNCINFER_KERNEL_CACHE")
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("asyncinfer")) / "kernels"


def _cpu_reason() -> str | None:
    """Why no variant could run on this CPU: never (the scalar reference runs everywhere); kept as the one
    place a future restriction would go."""
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def openmp_runtimes() -> list[str]:
    """The OpenMP runtimes mapped into this process (files whose name holds libgomp, libomp or libiomp),
    one path each: the kernels add none of their own."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps.splitlines()
             if line.split()[-1].startswith("/") and any(n in line.split()[-1].rsplit("/", 1)[-1]
                                                          for n in ("libgomp", "libomp", "libiomp"))}
    return sorted(paths)


def _torch_openmp() -> str | None:
    """The OpenMP runtime torch has loaded (its wheels ship their own libgomp, sometimes renamed): a
    run-time build links against that very file, so that the process keeps one runtime and one thread pool."""
    paths = [p for p in openmp_runtimes() if "libgomp" in p]
    return min(paths) if paths else None


# ---------------------------------------------------------------------------------------------------
# The private cache of run-time builds.

def _private_problem(path: Path, what: str) -> str | None:
    """Why ``path`` is not safe to load code from: not owned by this user, or writable by group/others."""
    try:
        st = path.lstat()
    except OSError as exc:
        return f"cannot inspect the kernel {what} {path} ({exc})"
    if stat.S_ISLNK(st.st_mode):
        return f"the kernel {what} {path} is a symbolic link; asyncinfer loads no code through it"
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid:
        return (f"the kernel {what} {path} is owned by uid {st.st_uid}, not by this user (uid {uid}); "
                f"asyncinfer loads no code from it (set ASYNCINFER_KERNEL_CACHE to a private directory)")
    if st.st_mode & 0o022:
        return (f"the kernel {what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"asyncinfer loads no code from it (set ASYNCINFER_KERNEL_CACHE to a private directory)")
    return None


def _ancestor_problem(directory: Path) -> str | None:
    """Why a directory above the cache lets another user replace it: one owned by someone other than this
    user or root (or a symbolic link they own: they may point it elsewhere), or writable by group/others
    without the sticky bit (which keeps others from renaming what they do not own)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for parent in Path(os.path.abspath(directory)).parents:
        try:
            link, st = parent.lstat(), parent.stat()
        except OSError as exc:
            return f"cannot inspect {parent}, above the kernel cache ({exc})"
        if stat.S_ISLNK(link.st_mode) and uid is not None and link.st_uid not in (0, uid):
            return (f"{parent}, above the kernel cache, is a symbolic link owned by uid {link.st_uid}, who could "
                    f"point it elsewhere; asyncinfer loads no code through it (set ASYNCINFER_KERNEL_CACHE to a "
                    f"private directory)")
        if uid is not None and st.st_uid not in (0, uid):
            return (f"{parent}, above the kernel cache, is owned by uid {st.st_uid}, who could replace the cache; "
                    f"asyncinfer loads no code from it (set ASYNCINFER_KERNEL_CACHE to a private directory)")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{parent}, above the kernel cache, is writable by group or others without the sticky bit "
                    f"(mode {stat.S_IMODE(st.st_mode):o}); asyncinfer loads no code from it (set "
                    f"ASYNCINFER_KERNEL_CACHE to a private directory)")
    return None


class _UnsafeCache(RuntimeError):
    pass


def _private_dir() -> Path:
    """The cache directory, created private (0700); refused (_UnsafeCache) when another user owns it or
    group/others can write to it."""
    directory = _cache_dir()
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass
    problem = _private_problem(directory, "cache directory") or _ancestor_problem(directory)
    if problem:
        raise _UnsafeCache(problem)
    return directory


def _sources() -> list[Path]:
    return sorted(_CSRC.glob("*.c"))


def _flags(isa: str, openmp: bool, extra: tuple[str, ...] = ()) -> list[str]:
    return [*BASE_FLAGS, *ISA_FLAGS[isa], *extra, *(["-fopenmp"] if openmp else [])]


def _build(compiler: str, isa: str, fresh: bool = False) -> Path:
    """The run-time build of ``isa`` in the private cache (reused when its digest matches). ``fresh``: build
    again and return it under a new file name (dlopen of a path already loaded returns the loaded library)."""
    sources = _sources()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    openmp = _torch_openmp()
    text = b"".join(p.name.encode() + p.read_bytes() for p in sorted([*sources, *_CSRC.glob("*.h")]))
    key = hashlib.sha256(text + " ".join(_flags(isa, True)).encode() + version.encode()
                         + str(openmp).encode()).hexdigest()
    directory = _private_dir()
    target = directory / f"kernels-{isa}-{key[:16]}.so"
    if not fresh and target.exists() and _digest_ok(target):
        return target
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = Path(tmp) / target.name
        try:
            _compile_and_link(compiler, isa, sources, Path(tmp), out, openmp, with_openmp=True)
        except RuntimeError:  # a compiler without OpenMP (Apple's clang): the kernels run on one thread
            _compile_and_link(compiler, isa, sources, Path(tmp), out, None, with_openmp=False)
        os.chmod(out, 0o700)
        digest = hashlib.sha256(out.read_bytes()).hexdigest()
        fresh_path = None
        if fresh:  # this process loads the new build under a name it has never opened
            fresh_path = directory / f"kernels-{isa}-{key[:16]}-{time.time_ns()}.so"
            try:
                os.link(out, fresh_path)
            except OSError:  # a file system without hard links
                shutil.copy2(out, fresh_path)
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same bytes
        sidecar = Path(tmp) / "digest"
        sidecar.write_text(digest)
        os.replace(sidecar, _digest_path(target))
    if fresh_path is not None:
        _digest_path(fresh_path).write_text(digest)
        return fresh_path
    return target


def _compile_and_link(compiler: str, isa: str, sources: list[Path], tmp: Path, out: Path, openmp: str | None,
                      with_openmp: bool, extra: tuple[str, ...] = ()) -> None:
    """Compile ``sources`` with ``isa``'s flags (and ``extra``: the tests' emulated AVX-512 build) into ``out``."""
    objects = [str(tmp / (src.stem + ".o")) for src in sources]
    commands = [[compiler, *_flags(isa, with_openmp, extra), "-I", str(_CSRC), "-c", str(sources[i]), "-o", objects[i]]
                for i in compile_order(sources)]
    # One compiler process a core, the largest sources first; a failure is raised.
    with ThreadPoolExecutor(max_workers=compilers_at_once(len(commands))) as pool:
        for done in [pool.submit(_run, cmd, compiler) for cmd in commands]:
            done.result()
    if openmp:  # link to torch's runtime by its path (and soname), not to another copy
        _run([compiler, "-shared", *objects, openmp, f"-Wl,-rpath,{Path(openmp).parent}", "-lm", "-o", str(out)],
             compiler)
    else:
        _run([compiler, "-shared", *(["-fopenmp"] if with_openmp else []), *objects, "-lm", "-o", str(out)],
             compiler)


def _run(cmd: list[str], compiler: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")


def _digest_path(build: Path) -> Path:
    return build.with_suffix(".sha256")


def _digest_ok(build: Path) -> bool:
    """Whether a cached build is the file its build wrote (a truncated one would crash the process in
    dlopen, before Python could catch anything)."""
    try:
        return hashlib.sha256(build.read_bytes()).hexdigest() == _digest_path(build).read_text().strip()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------
# Loading.

def _checked(lib: ctypes.CDLL, isa: str) -> ctypes.CDLL:
    """``lib`` once it says it is this Python side's ABI version and the variant asked for; RuntimeError
    otherwise."""
    version = lib.asyncinfer_kernels_version()
    if version != _VERSION:
        raise RuntimeError(f"a library of ABI version {version}, not {_VERSION}")
    built = lib.asyncinfer_kernels_isa()
    if built >= len(ISAS) or ISAS[built] != isa:
        raise RuntimeError(f"a library built as variant {built}, not {isa}")
    return lib


def _open_cached(compiler: str, isa: str) -> tuple[ctypes.CDLL, Path]:
    """Load the run-time build; one that cannot be loaded (a stale file in the cache) is rebuilt once, under a
    new file name. torch is imported (and its OpenMP runtime loaded) first: the kernels share that runtime."""
    path = _build(compiler, isa)
    for attempt in range(2):
        problem = _private_problem(path, "library")
        if problem:
            raise _UnsafeCache(problem)
        try:
            return _checked(ctypes.CDLL(str(path)), isa), path
        except (OSError, RuntimeError, AttributeError):
            if attempt:
                raise
            path = _build(compiler, isa, fresh=True)
    raise AssertionError("unreachable")


def _runtime_build_forced() -> bool:
    """``ASYNCINFER_KERNEL_RUNTIME_BUILD=1``: the run-time build even where ``pip install`` built the libraries
    (a developer editing the C sources of an editable install)."""
    return os.environ.get("ASYNCINFER_KERNEL_RUNTIME_BUILD", "").strip().lower() not in ("", "0", "false", "no")


def _installed_stale() -> bool:
    """Whether the installed libraries were built from other sources than the package holds (an editable
    install whose C was edited since ``pip install -e .``): then the run-time build runs instead."""
    try:
        return (_HERE / SOURCES_STAMP).read_text().strip() != sources_digest(_CSRC)
    except OSError:
        return True


def _open_variant(isa: str) -> tuple[ctypes.CDLL, dict]:
    """The library of one variant, configured, and where it came from: the installed one if it loads, else
    the run-time build. Raises RuntimeError (or _UnsafeCache) saying why neither could be loaded."""
    if isa in _variants:
        return _variants[isa]
    installed = _HERE / library_name(isa)
    info: dict = {"isa": isa}
    stale = installed.exists() and _installed_stale()
    if stale:
        info["installed_error"] = f"{installed}: built from other sources than {_CSRC} holds now"
    if installed.exists() and not stale and not _runtime_build_forced():
        try:
            lib = _checked(ctypes.CDLL(str(installed)), isa)
            info.update(source="installed", path=str(installed))
        except (OSError, RuntimeError, AttributeError) as exc:
            info["installed_error"] = f"{installed}: {exc}"
            lib = None
    else:
        lib = None
    if lib is None:
        compiler = _compiler()
        if compiler is None:
            why = info.get("installed_error", f"no library was installed ({installed.name})")
            raise RuntimeError(f"{why}, and no C compiler (cc, gcc or clang) is on PATH to build them")
        try:
            lib, path = _open_cached(compiler, isa)
        except _UnsafeCache:
            raise
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            raise RuntimeError(f"building them failed: {exc}") from exc
        info.update(source="cache", path=str(path))
    _configure(lib)
    if lib.asyncinfer_panel_min_rows() != PANEL_MIN_ROWS:
        raise RuntimeError("the built library disagrees with PANEL_MIN_ROWS")
    if lib.asyncinfer_step_tile_min_rows() != STEP_TILE_MIN_ROWS:
        raise RuntimeError("the built library disagrees with STEP_TILE_MIN_ROWS")
    info["openmp"] = openmp_runtimes()
    _variants[isa] = (lib, info)
    return lib, info


def _raise_memory(result: int, func, args):  # ctypes errcheck
    if result == -1:
        raise MemoryError(f"{func.__name__}: the kernels could not allocate their working memory")
    if result == -2:
        raise ValueError(f"{func.__name__}: a size the kernel divides by is 0 or the sizes disagree")
    return result


def _scratch_size(result: int, func, args):  # ctypes errcheck
    if result < 0:
        raise MemoryError(f"asyncinfer_scratch_bytes: a GEMM of {args[0]} rows by {args[1]} would need more "
                          f"working memory than a size can hold")
    return result


def _configure(lib: ctypes.CDLL) -> None:
    P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for fmt in BLOCK_FORMATS:
        fn = getattr(lib, f"asyncinfer_gemm_{fmt}")
        fn.argtypes = [P, I64, I64, I64, P, I64, P, P, I64, INT, P]
        fn.restype = INT
        fn.errcheck = _raise_memory
    lib.asyncinfer_gemm.argtypes = [INT, P, I64, I64, I64, P, I64, P, P, I64, INT, P]
    lib.asyncinfer_gemm.restype = INT
    lib.asyncinfer_gemm.errcheck = _raise_memory
    lib.asyncinfer_rms_norm.argtypes = [P, I64, I64, I64, P, F32, P, INT]
    lib.asyncinfer_rms_norm.restype = None
    lib.asyncinfer_decode_attention.argtypes = [P, P, P, P, I64, P, I64, I64, I64, I64, I64, F32, F32, I64, P, INT]
    lib.asyncinfer_decode_attention.restype = INT
    lib.asyncinfer_decode_attention.errcheck = _raise_memory
    lib.asyncinfer_decode_layer.argtypes = [P, P, I64, P, P, P, P, P, P, I64, P, I64, INT, P]
    lib.asyncinfer_decode_layer.restype = INT
    lib.asyncinfer_embed_rows.argtypes = [P, P, I64, I64, P, I64]
    lib.asyncinfer_embed_rows.restype = INT
    lib.asyncinfer_decode_stack.argtypes = [P, I64, P, P, I64, P, P, P, P, P, I64, I64, P, F32, P, P, INT, I64,
                                            F32, P, P, P, P, I64, P, I64, I64, INT, P]
    lib.asyncinfer_decode_stack.restype = INT
    lib.asyncinfer_argmax.argtypes = [P, I64, I64, I64, P]
    lib.asyncinfer_argmax.restype = None
    lib.asyncinfer_check_paged.argtypes = [P, I64, P, P, I64, I64, I64]
    lib.asyncinfer_check_paged.restype = INT
    lib.asyncinfer_dequantize_bf16.argtypes = [INT, P, I64, I64, P, I64, INT]
    lib.asyncinfer_dequantize_bf16.restype = INT
    lib.asyncinfer_scratch_bytes.argtypes = [I64, I64]
    lib.asyncinfer_scratch_bytes.restype = I64
    lib.asyncinfer_scratch_bytes.errcheck = _scratch_size
    for name in ("asyncinfer_cpu_isas", "asyncinfer_kernels_isa", "asyncinfer_kernels_version",
                 "asyncinfer_panel_min_rows", "asyncinfer_step_tile_min_rows"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], INT


def _cpu_isas() -> tuple[str, ...]:
    """The variants this CPU runs, as the scalar library's cpuid check says (scalar alone off x86)."""
    built = isas_for()
    if built == ("scalar",):
        return built
    lib, _ = _open_variant("scalar")
    mask = lib.asyncinfer_cpu_isas()
    return tuple(isa for i, isa in enumerate(ISAS) if mask >> i & 1 and isa in built)


#: How every refusal of ``ASYNCINFER_KERNEL_ISA`` ends: the values it takes.
_ISA_HINT = f"(allowed values: {', '.join(ISAS)}, case ignored; unset or empty: the best this CPU runs)"


def _requested() -> str | None:
    """The variant ``ASYNCINFER_KERNEL_ISA`` names (case and surrounding spaces ignored), None when it is unset
    or empty; KernelISAError when it names none."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in ISAS:
        raise KernelISAError(f"{ISA_ENV}={os.environ[ISA_ENV]!r} names no kernel variant {_ISA_HINT}")
    return value


def _load() -> None:
    global _lib, _reason, _tried, _info, _supported, _error, _forced
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
        try:
            # What this CPU runs, whatever ASYNCINFER_KERNEL_ISA says (the scalar library's cpuid check): a
            # bad value is then reported with the values that would work here.
            _supported = _cpu_isas()
            try:
                requested = _requested()
                if requested is not None and requested not in _supported:
                    raise KernelISAError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: this CPU runs only "
                                         f"{', '.join(_supported)} {_ISA_HINT}")
            except KernelISAError as exc:
                _error, _reason = exc, str(exc)
                return
            chosen = requested or _supported[-1]
            _forced = requested is not None
            _lib, _info = _open_variant(chosen)
        except RuntimeError as exc:  # _UnsafeCache included: its message says which file and why
            _reason, _lib = str(exc), None
        except (OSError, AttributeError) as exc:
            _reason, _lib = f"loading them failed: {exc}", None


def available() -> bool:
    """Whether the kernels run here (on the first call, loads the installed library, or builds them, ~1 s).
    False where they cannot (:func:`unavailable_reason` says why), a bad ``ASYNCINFER_KERNEL_ISA`` included
    (one that names no variant, or one this CPU lacks); never raises."""
    _load()
    return _lib is not None


def auto_reason() -> str | None:
    """Why ``quantization="auto"`` passes over a model's own block format here, None where it takes it: the
    kernels cannot run (:func:`unavailable_reason`), or only the scalar reference runs on this CPU and
    ``ASYNCINFER_KERNEL_ISA`` did not ask for it (the reference, plain C, decodes a batch many times slower
    than float16 weights on torch's own kernels: docs/formats.md, "Kernel variants"). Never raises."""
    _load()
    if _lib is None:
        return _reason
    if _info is not None and _info["isa"] == "scalar" and not _forced:
        return ("only the scalar reference of the kernels runs on this CPU (no AVX2): q4_1 / q8_0 work when "
                "asked for, but float16 is faster here")
    return None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True); for a bad ``ASYNCINFER_KERNEL_ISA``, the
    :class:`KernelISAError`'s message, which names the values allowed. Never raises."""
    _load()
    return _reason


def lib() -> ctypes.CDLL:
    """The loaded library (loaded or built on the first call); RuntimeError naming why where the kernels
    cannot run (a bad ``ASYNCINFER_KERNEL_ISA`` included: its :class:`KernelISAError` is the cause)."""
    if _lib is not None:
        return _lib
    _load()
    if _lib is None:
        raise RuntimeError(f"asyncinfer's kernels cannot run here: {_reason}") from _error
    return _lib


def loaded() -> bool:
    """Whether the kernels are already built and loaded in this process (never builds them, unlike
    :func:`available`): for callers that use them only when something else has (the sampler)."""
    return _lib is not None


def isa() -> str:
    """The variant the kernels run as here: ``"scalar"``, ``"avx2"``, ``"avx512"`` or ``"avx512vnni"``. RuntimeError naming
    :func:`unavailable_reason` where they cannot run."""
    return _info_or_raise()["isa"]


def lanes_native() -> bool:
    """Whether the loaded variant multiplies Q4_0 and Q4_1 in lanes in vector code (:data:`LANES_ISAS`);
    RuntimeError naming :func:`unavailable_reason` where the kernels cannot run."""
    return isa() in LANES_ISAS


def int16_batched() -> str:
    """How the loaded variant's int16 GEMM (the default ``activation_dtype``) multiplies from
    :data:`PANEL_MIN_ROWS` rows on: ``"tile"`` (int16 activations, the rows' numerics: the AVX-512 variants,
    :data:`INT16_TILE_ISAS`) or ``"panel"`` (float32 activations: scalar, avx2). RuntimeError naming
    :func:`unavailable_reason` where the kernels cannot run."""
    return "tile" if isa() in INT16_TILE_ISAS else "panel"


def supported_isas() -> tuple[str, ...]:
    """The variants this CPU runs, slowest first (``"scalar"``, then the x86 ones its CPU has): the values
    ``ASYNCINFER_KERNEL_ISA`` may take here. Answers whatever that variable says (on x86 it runs the scalar
    library's cpuid check, loading or building that library regardless of it). Empty where nothing can be
    told: the kernels are disabled (``ASYNCINFER_DISABLE_KERNELS``) or the scalar library cannot be loaded or
    built (:func:`unavailable_reason` says why). Never raises."""
    _load()
    return _supported or ()


def build_info() -> dict:
    """Where the loaded library came from: ``isa``, ``source`` (``"installed"``: built by ``pip install``;
    ``"cache"``: built at run time into the user cache), ``path``, ``openmp`` (the OpenMP runtimes mapped in
    the process when it loaded), and ``installed_error`` when an installed library was there but not loaded
    (why: built from other sources than the package holds now, another ABI version, not loadable). RuntimeError
    naming :func:`unavailable_reason` where the kernels cannot run."""
    return dict(_info_or_raise())


def _info_or_raise() -> dict:
    lib()
    assert _info is not None
    return _info


def variant(isa_name: str) -> ctypes.CDLL:
    """The library of one variant, loaded beside the one in use (for comparing variants; the public
    functions run on :func:`lib`'s). KernelISAError for a variant this CPU does not run."""
    lib()
    assert _supported is not None
    if isa_name not in _supported:
        raise KernelISAError(f"variant {isa_name!r}: this CPU runs only {', '.join(_supported)}")
    with _lock:
        return _open_variant(isa_name)[0]
