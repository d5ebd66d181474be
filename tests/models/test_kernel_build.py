"""Where the kernels' library comes from and what loading it leaves in the process: the installed library
shares torch's one OpenMP runtime; the run-time build's cache is private, refused when it is not, and a
rebuilt library is loaded under a new name; allocation failures and overflowing sizes are MemoryError."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncinfer import kernels
from asyncinfer.kernels import _build
from asyncinfer.kernels._variants import isas_for, library_name

REPORT = ("from asyncinfer import kernels\n"
          "ok = kernels.available()\n"
          "print(ok, kernels.build_info()['path'] if ok else kernels.unavailable_reason())\n")


def run(code: str, cache: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "ASYNCINFER_DISABLE_KERNELS": "0", **env}
    full.pop("ASYNCINFER_KERNEL_ISA", None)
    if cache is not None:
        full.update(ASYNCINFER_KERNEL_CACHE=str(cache), ASYNCINFER_KERNEL_RUNTIME_BUILD="1")
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=600,
                          check=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A run-time build's cache, built once into a directory that did not exist (every test works on a copy)."""
    root = tmp_path_factory.mktemp("kernel-cache") / "new" / "cache"
    proc = run(REPORT, root)
    assert proc.stdout.startswith("True"), proc.stdout + proc.stderr[-2000:]
    return root


def copy_of(cache: Path, tmp_path: Path) -> Path:
    target = tmp_path / "cache"
    shutil.copytree(cache, target)
    return target


def test_the_installed_library_shares_torchs_one_openmp_runtime() -> None:
    """pip install builds a library per variant, with OpenMP symbols left to the runtime torch loaded: after
    loading it and running a kernel on two threads, one libgomp is mapped, torch's."""
    if not all((Path(_build.__file__).parent / library_name(isa)).exists() for isa in isas_for()):
        if os.environ.get("CI") == "true":  # CI installs with pip install -e: the libraries must be there
            pytest.fail("pip install -e . built no kernel libraries (is a C compiler installed?)")
        pytest.skip("no installed libraries (a checkout on PYTHONPATH: pip install -e . builds them)")
    code = ("import torch\n"
            "torch.set_num_threads(2)\n"
            "from asyncinfer import kernels\n"
            "from asyncinfer.kernels._build import openmp_runtimes\n"
            "w = kernels.pack(kernels.quantize(torch.randn(64, 256), 'q4_1'), 'q4_1')\n"
            "for rows in (1, 8):\n"
            "    kernels.gemm(torch.randn(rows, 256), w, 'q4_1', 64)\n"
            "info = kernels.build_info()\n"
            "print(info['source'], info['isa'], *openmp_runtimes())\n")
    proc = run(code)
    words = proc.stdout.split()
    assert words[:2] == ["installed", kernels.supported_isas()[-1]], proc.stdout + proc.stderr[-2000:]
    runtimes = words[2:]
    assert len(runtimes) == 1 and "libgomp" in runtimes[0], runtimes
    assert Path(runtimes[0]).resolve().is_relative_to(Path(torch.__file__).resolve().parent.parent), runtimes


def test_the_cache_directory_is_created_private(cache) -> None:
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert [p.name for p in cache.glob("kernels-*.so")]
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o022 == 0 for p in cache.glob("*.so"))


def test_a_cache_writable_by_others_is_refused(cache, tmp_path) -> None:
    root = copy_of(cache, tmp_path)
    root.chmod(0o777)
    proc = run(REPORT, root)
    assert proc.stdout.startswith("False") and "writable by group or others" in proc.stdout, proc.stdout
    assert str(root) in proc.stdout and "ASYNCINFER_KERNEL_CACHE" in proc.stdout
    root.chmod(0o700)
    for lib in root.glob("*.so"):  # a private directory, but a library anyone may rewrite
        lib.chmod(0o777)
    proc = run(REPORT, root)
    assert proc.stdout.startswith("False") and "library" in proc.stdout and "writable" in proc.stdout, proc.stdout


def test_a_cache_below_a_directory_others_may_write_is_refused(cache, tmp_path) -> None:
    """A private cache is still replaceable when a directory above it lets others rename entries: refused
    without the sticky bit, taken with it (as under /tmp)."""
    parent = tmp_path / "shared"
    parent.mkdir()
    root = shutil.copytree(cache, parent / "cache")
    parent.chmod(0o777)
    proc = run(REPORT, root)
    assert proc.stdout.startswith("False") and f"{parent}, above the kernel cache" in proc.stdout, proc.stdout
    parent.chmod(0o777 | stat.S_ISVTX)
    proc = run(REPORT, root)
    assert proc.stdout.startswith("True"), proc.stdout + proc.stderr[-2000:]


def test_a_cache_owned_by_another_user_is_refused(cache, tmp_path) -> None:
    if os.getuid() != 0:
        pytest.skip("only root can hand a directory to another user")
    root = copy_of(cache, tmp_path)
    os.chown(root, 4242, 4242)
    proc = run(REPORT, root)
    assert proc.stdout.startswith("False") and "owned by uid 4242" in proc.stdout, proc.stdout
    os.chown(root, 0, 0)
    for lib in root.glob("*.so"):
        os.chown(lib, 4242, 4242)
    proc = run(REPORT, root)
    assert proc.stdout.startswith("False") and "owned by uid 4242" in proc.stdout, proc.stdout


def test_a_cache_below_a_symbolic_link_another_user_owns_is_refused(cache, tmp_path) -> None:
    """A link above the cache that another user owns can be pointed elsewhere at any time (a link of theirs
    in /tmp, whose sticky bit does not stop its owner): refused, though what it points to now is private."""
    if os.getuid() != 0:
        pytest.skip("only root can hand a symbolic link to another user")
    real = tmp_path / "real"
    real.mkdir()
    shutil.copytree(cache, real / "cache")
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, 4242, 4242)
    proc = run(REPORT, link / "cache")
    assert proc.stdout.startswith("False") and f"{link}, above the kernel cache, is a symbolic link owned by uid 4242" \
        in proc.stdout, proc.stdout
    os.lchown(link, os.getuid(), os.getgid())  # this user's own link: taken
    proc = run(REPORT, link / "cache")
    assert proc.stdout.startswith("True"), proc.stdout + proc.stderr[-2000:]


def test_a_corrupt_cached_build_is_rebuilt(cache, tmp_path) -> None:
    """The run-time build's cache holds one build per variant, source, compiler and OpenMP runtime, with the
    digest its build wrote; a truncated file there is rebuilt, never loaded."""
    root = copy_of(cache, tmp_path)
    builds = sorted(root.glob("kernels-*.so"))
    assert builds, "no run-time build in the cache"
    for build in builds:
        build.write_bytes(build.read_bytes()[:4096])  # truncated: dlopen would die of SIGBUS on it
    proc = run("from asyncinfer import kernels; print(kernels.available(), kernels.unavailable_reason(), "
               "kernels.build_info()['source'])", root)
    assert proc.stdout.split() == ["True", "None", "cache"], proc.stderr[-2000:]
    assert all(build.stat().st_size > 10_000 for build in builds)


def test_a_stale_build_is_rebuilt_and_loaded_under_a_new_name(cache, tmp_path) -> None:
    """A cached library of another ABI version (its digest intact) is loaded, refused, rebuilt, and the
    rebuild loaded from a new file: dlopen of the old path would return the stale library again."""
    root = copy_of(cache, tmp_path)
    best = kernels.supported_isas()[-1]
    (target,) = [p for p in root.glob(f"kernels-{best}-*.so")]
    src = tmp_path / "stale.c"
    src.write_text("int asyncinfer_kernels_version(void) { return 1; }\n"
                   "int asyncinfer_kernels_isa(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(target)], check=True, timeout=120)
    target.chmod(0o700)
    import hashlib

    target.with_suffix(".sha256").write_text(hashlib.sha256(target.read_bytes()).hexdigest())
    proc = run(REPORT, root)
    words = proc.stdout.split()
    assert words[0] == "True", proc.stdout + proc.stderr[-2000:]
    loaded = Path(words[1])
    assert loaded != target and loaded.parent == root and loaded.name.startswith(target.stem + "-"), loaded
    assert target.stat().st_size > 10_000  # the canonical name holds the rebuild too, for the next process


def test_allocation_failures_and_overflowing_sizes_raise_memory_error() -> None:
    lib = _build.lib()
    with pytest.raises(MemoryError, match="working memory"):
        lib.asyncinfer_scratch_bytes(1 << 40, 1 << 40)
    # the int16 values, then three floats a block of 32 (its scale, its sum, the pair layout's integer sum)
    assert lib.asyncinfer_scratch_bytes(4, 64) == 4 * 64 * 2 + 3 * 4 * 2 * 4
    # Attention's scores for a context of 2^61 keys: a size that overflows, refused before anything is read.
    q, out = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    ctx, tables = torch.tensor([1 << 61]), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(MemoryError, match="asyncinfer_decode_attention"):
        lib.asyncinfer_decode_attention(q.data_ptr(), q.data_ptr(), q.data_ptr(), tables.data_ptr(), 1,
                                        ctx.data_ptr(), 1, 1, 1, 8, 16, 1.0, 0.0, 0, out.data_ptr(), 1)
    # A layer whose working memory overflows: -1 (DecodeLayer raises MemoryError for it), nothing touched.
    from asyncinfer.kernels.decoder import _Layer

    huge = _Layer(hidden=64, H=1 << 40, KVH=1 << 40, D=1 << 20, I=1 << 40, eps=1e-5, scale=1.0)  # no weights
    assert lib.asyncinfer_decode_layer(ctypes.byref(huge), None, 1, None, None, None, None, None, None, 1, None, 16,
                                       1, None) == -1


def test_installed_libraries_built_from_other_sources_are_not_loaded(tmp_path, monkeypatch) -> None:
    """An editable install whose C was edited after pip install -e: the stamp setup.py wrote no longer
    matches the sources, so the run-time build runs instead of the stale libraries."""
    from asyncinfer.kernels._variants import SOURCES_STAMP, sources_digest

    csrc = tmp_path / "csrc"
    shutil.copytree(Path(_build.__file__).parent / "csrc", csrc)
    monkeypatch.setattr(_build, "_HERE", tmp_path)
    monkeypatch.setattr(_build, "_CSRC", csrc)
    assert _build._installed_stale()  # no stamp: nothing says what they were built from
    (tmp_path / SOURCES_STAMP).write_text(sources_digest(csrc))
    assert not _build._installed_stale()
    gemm = csrc / "gemm.c"
    gemm.write_text(gemm.read_text() + "\n/* edited */\n")
    assert _build._installed_stale()
