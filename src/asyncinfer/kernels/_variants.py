"""The kernels' ISA variants and how each is compiled: the one list that the install-time build
(``setup.py``, which loads this file by path, without torch) and the run-time build (``_build.py``) share.

Every variant is the same sources (``csrc/*.c``) built with other flags into its own shared library; the
compiler's flags select the code (``csrc/internal.h``). Imports nothing beyond the standard library.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Sequence
from pathlib import Path

#: Every variant, slowest first: the scalar reference (plain C, every machine), AVX2 + FMA + F16C,
#: AVX-512 F/BW/VL on top of those, and AVX-512 VNNI on top of that (the same results as avx512: only the
#: integer dot products' instructions differ).
ISAS = ("scalar", "avx2", "avx512", "avx512vnni")
#: The environment switch that forces a variant.
ISA_ENV = "ASYNCINFER_KERNEL_ISA"

BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-fvisibility=hidden")
ISA_FLAGS = {
    # The reference rounds every product and sum on its own (no fused multiply-add by the compiler).
    "scalar": ("-ffp-contract=off",),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"),
    "avx512vnni": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
}
X86_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")


def isas_for(machine: str | None = None) -> tuple[str, ...]:
    """The variants built for a machine architecture (``platform.machine()``): every one on x86, the
    scalar reference elsewhere."""
    machine = (machine if machine is not None else platform.machine()).lower()
    return ISAS if machine in X86_MACHINES else ("scalar",)


def library_name(isa: str) -> str:
    """The installed library's file name, next to this module."""
    return f"_kernels_{isa}.so"


#: The file ``setup.py`` writes beside the libraries it builds: :func:`sources_digest` of what it built.
SOURCES_STAMP = "_kernels.sources"


def sources_digest(csrc: Path) -> str:
    """A digest of the C sources and headers in ``csrc``: an installed library built from other sources (an
    editable install whose C has been edited since) is not loaded."""
    digest = hashlib.sha256()
    for path in sorted([*csrc.glob("*.c"), *csrc.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def compile_order(sources: Sequence[str | Path]) -> list[int]:
    """The indices of ``sources``, the largest file first: the order both builds start their compilers in (the
    largest sources take most of the time)."""
    return sorted(range(len(sources)), key=lambda i: -Path(sources[i]).stat().st_size)


def compilers_at_once(jobs: int) -> int:
    """How many compilers a build runs at once for ``jobs`` sources: one a core this process may run on (its CPU
    affinity where the OS has one), at most ``jobs``, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(jobs, cores))
