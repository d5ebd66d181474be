"""The package's public names are exactly the ones docs/api.md documents."""

from __future__ import annotations

import re
from pathlib import Path

import asyncinfer

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def documented_names() -> set[str]:
    """The names in the first column of docs/api.md's tables (before "Beyond the package root")."""
    text = API_DOC.read_text(encoding="utf-8").split("## Beyond the package root")[0]
    return set(re.findall(r"^\| `([A-Za-z_]+)` \|", text, flags=re.MULTILINE))


def test_all_equals_the_documented_names() -> None:
    assert set(asyncinfer.__all__) == documented_names()


def test_every_public_name_exists_and_has_a_docstring() -> None:
    for name in asyncinfer.__all__:
        obj = getattr(asyncinfer, name)
        if name != "__version__":
            assert obj.__doc__, f"{name} has no docstring"


def test_errors_form_one_tree() -> None:
    errors = [getattr(asyncinfer, n) for n in asyncinfer.__all__ if n.endswith("Error")]
    assert all(issubclass(e, asyncinfer.AsyncInferError) for e in errors)
    assert issubclass(asyncinfer.WrongEventLoopError, asyncinfer.EngineClosedError)


def test_the_package_root_is_cheap_and_loads_names_and_submodules_on_first_use() -> None:
    """``import asyncinfer`` imports neither torch nor typing (the command's Ctrl-C guard runs first);
    names and submodules still resolve from a bare ``import asyncinfer``."""
    import subprocess
    import sys

    code = ("import sys, asyncinfer\n"
            "assert not {'torch', 'typing', 'asyncinfer.engine'} & set(sys.modules), sorted(sys.modules)\n"
            "assert asyncinfer.AsyncEngine.__module__ == 'asyncinfer.engine' and 'torch' in sys.modules\n"
            "assert callable(asyncinfer.metrics.asgi_app) and 'trim_messages' in dir(asyncinfer)\n"
            "assert not hasattr(asyncinfer, 'no_such_name')\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=API_DOC.parents[1])
