"""A fourth stranger's first hour: what failed with a traceback or misled, each held to its fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"stranger4_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ray_serve_without_a_cluster_at_address_is_one_line(monkeypatch, capsys) -> None:
    pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    example = load_example("ray_serve")

    def init(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(example.ray, "init", init)
    monkeypatch.setattr("sys.argv", ["ray_serve.py", "--address", "auto"])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == ("ray_serve.py: error: cannot connect to Ray at --address auto: "
                   "Could not find any running Ray instance.\n")
