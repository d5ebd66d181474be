"""Builds asyncinfer's CPU kernels when the package is installed (``pip install .`` / ``pip install -e .``):
one plain shared library per ISA variant (``asyncinfer/kernels/_kernels_<isa>.so``; the x86 variants on x86
only), loaded by ctypes by path, never imported as Python modules. Everything else is in pyproject.toml.

OpenMP: compiled with ``-fopenmp`` where the compiler takes it, but linked to no OpenMP runtime, so that its
symbols resolve, when the library is loaded, against the runtime torch has already loaded for the process
(one runtime, one thread pool; torch may be absent while building). ``optional=True``: an install without
a C compiler (or one that cannot build a variant) still succeeds, and the kernels are built on first use
instead (or are unavailable, saying why). A variant's sources compile in parallel, one compiler a core, largest
first (each library links once its objects are built; the variants, which share object paths, one after another).
"""

from __future__ import annotations

import os
import runpy
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
KERNELS = Path("src", "asyncinfer", "kernels")
variants = runpy.run_path(str(HERE / KERNELS / "_variants.py"))
SOURCES = sorted(str(p.relative_to(HERE)) for p in (HERE / KERNELS / "csrc").glob("*.c"))
HEADERS = sorted(str(p.relative_to(HERE)) for p in (HERE / KERNELS / "csrc").glob("*.h"))


class BuildKernels(build_ext):
    """Per-variant flags, OpenMP where the compiler has it, and plain ``.so`` file names."""

    def build_extensions(self) -> None:
        openmp = self._accepts(["-fopenmp"])
        for ext in self.extensions:
            isa = ext.name.rsplit("_", 1)[-1]
            ext.extra_compile_args = ["-g0", *variants["BASE_FLAGS"], *variants["ISA_FLAGS"][isa],
                                      *(["-fopenmp"] if openmp else [])]
        self.compiler.compile = _one_source_a_core(self.compiler.compile)
        self.parallel = None  # the variants one after another: they share object paths (build_ext -j would mix them)
        super().build_extensions()

    def run(self) -> None:
        super().run()
        # What the libraries were built from, beside them (_build.py loads them only while it matches).
        targets = {Path(self.build_lib, "asyncinfer", "kernels")}
        if self.inplace:
            targets.add(Path(self.get_finalized_command("build_py").get_package_dir("asyncinfer.kernels")))
        for target in targets:
            if target.is_dir():
                (target / variants["SOURCES_STAMP"]).write_text(variants["sources_digest"](HERE / KERNELS / "csrc"))

    def get_ext_filename(self, fullname: str) -> str:
        package, _, name = fullname.rpartition(".")
        return os.path.join(*package.split("."), variants["library_name"](name.rsplit("_", 1)[-1]))

    def _accepts(self, flags: list[str]) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "probe.c"
            src.write_text("#include <omp.h>\nint probe(void) { return omp_get_max_threads(); }\n")
            try:
                self.compiler.compile([str(src)], output_dir=tmp, extra_postargs=flags)
            except Exception:  # noqa: BLE001 - any failure means: build without OpenMP
                return False
        return True


def _one_source_a_core(compile_sources):
    """``compile_sources`` (a compiler's ``compile``) called once per source, in the run-time build's order and
    number at once (``_variants.compile_order``, ``compilers_at_once``): the object files in the sources' order, as
    one call returns them (its first failure raised)."""

    def compile_in_parallel(sources, *args, **kwargs):
        sources = list(sources)
        if len(sources) < 2:
            return compile_sources(sources, *args, **kwargs)
        with ThreadPoolExecutor(max_workers=variants["compilers_at_once"](len(sources))) as pool:
            done = {i: pool.submit(compile_sources, [sources[i]], *args, **kwargs)
                    for i in variants["compile_order"](sources)}
            try:
                return [obj for i in range(len(sources)) for obj in done[i].result()]
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the first failure: the sources not started are not compiled
                raise

    return compile_in_parallel


setup(
    ext_modules=[
        Extension(f"asyncinfer.kernels._kernels_{isa}", sources=SOURCES, depends=HEADERS,
                  include_dirs=[str(KERNELS / "csrc")], libraries=["m"], optional=True)
        for isa in variants["isas_for"]()
    ],
    cmdclass={"build_ext": BuildKernels},
)
