"""The rooms' import rules (docs/architecture.md) hold: pyproject.toml's [tool.importlinter]
contracts, run by lint-imports (import-linter's command). And the repository passes ``ruff check``
with pyproject.toml's [tool.ruff.lint] rules."""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import asyncinfer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(asyncinfer.__file__).resolve().parent  # the code these tests import (src/asyncinfer)


def lint_imports(project: Path, source: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` (import-linter, the dev extra) on the package under ``source``, with ``project``'s contracts."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install the dev extra (pip install -e '.[dev]'), which has import-linter")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([exe, "--no-cache", "--no-logo", str(project / "pyproject.toml")], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def ruff_check(project: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    """``ruff check`` (the dev extra) over ``paths`` in ``project``, with the rules of its pyproject.toml."""
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff not found: install the dev extra (pip install -e '.[dev]'), which has ruff")
    return subprocess.run([exe, "check", "--no-cache", "--output-format", "concise", *paths], cwd=project,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_import_contracts_hold() -> None:
    proc = lint_imports(ROOT, PACKAGE.parent)
    assert proc.returncode == 0, f"an import contract is broken:\n{proc.stdout}\n{proc.stderr}"
    assert "Contracts: 6 kept, 0 broken." in proc.stdout


def test_the_kernels_contract_names_every_other_module() -> None:
    """'The kernels import nothing else of asyncinfer': its forbidden list is every other top-level module."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    (kernels,) = [c for c in config["contracts"] if c["id"] == "kernels-alone"]
    modules = {f"asyncinfer.{m.name}" for m in pkgutil.iter_modules(asyncinfer.__path__)}
    assert kernels["source_modules"] == ["asyncinfer.kernels"]
    assert set(kernels["forbidden_modules"]) == modules - {"asyncinfer.kernels"}


def test_a_lazy_upward_import_breaks_the_contracts(tmp_path: Path) -> None:
    """A function-level import of the engine in the lab counts: lint-imports fails and says where."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    copy = tmp_path / "src" / "asyncinfer"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "lab" / "trace.py").open("a", encoding="utf-8") as fh:
        fh.write("\n\ndef _engine() -> object:\n    from asyncinfer.engine import AsyncEngine\n\n    return AsyncEngine\n")
    proc = lint_imports(tmp_path, tmp_path / "src")
    assert proc.returncode == 1
    assert "The policy lab never imports the engine or what runs the model BROKEN" in proc.stdout
    assert "asyncinfer.lab.trace -> asyncinfer.engine" in proc.stdout
    assert "Contracts: 4 kept, 2 broken." in proc.stdout  # the layers and the lab's own rule


def test_the_repository_passes_ruff() -> None:
    proc = ruff_check(ROOT, ".")
    assert proc.returncode == 0, f"ruff check has findings (fix them; see [tool.ruff.lint]):\n{proc.stdout}\n{proc.stderr}"


def test_ruff_reports_a_finding_with_the_projects_rules(tmp_path: Path) -> None:
    """The check above can fail: a broad except (BLE001, not in ruff's pre-0.16 default) is reported by name."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "bad.py").write_text('try:\n    n = int("1")\nexcept Exception:\n    n = 0\n', encoding="utf-8")
    proc = ruff_check(tmp_path, ".")
    assert proc.returncode == 1
    assert [line for line in proc.stdout.splitlines() if line.startswith("bad.py")] == [
        "bad.py:3:8: BLE001 Do not catch blind exception: `Exception`"]
