"""examples/ray_serve.py without Ray installed (stranger41)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_serve.py"


# Run without Ray, `python examples/ray_serve.py` died with a ModuleNotFoundError traceback ("import of ray halted" /
# "No module named 'ray'"), where examples/discord_bot.py without discord.py says in one line what to install. It now
# says the same: the extra that brings Ray Serve.
@pytest.mark.parametrize("missing", ["ray", "ray.serve"])
def test_the_ray_example_without_ray_names_the_extra_to_install(monkeypatch, missing) -> None:
    monkeypatch.setitem(sys.modules, missing, None)
    monkeypatch.delitem(sys.modules, "asyncinfer.serve_ray", raising=False)
    spec = importlib.util.spec_from_file_location("ray_serve_without_ray", EXAMPLE)
    assert spec is not None and spec.loader is not None
    with pytest.raises(SystemExit) as exited:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert exited.value.code == "examples/ray_serve.py needs Ray Serve: pip install 'asyncinfer[ray]'"
