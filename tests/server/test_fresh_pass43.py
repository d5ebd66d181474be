"""pass43: the name ``asyncinfer serve .`` serves a model under.

docs/serving.md says ``asyncinfer serve`` names a model after its file (without ``.gguf``) or directory; but the name
was the last part of the path as typed, so ``asyncinfer serve .`` (or ``./``, ``models/..``, ``ASYNCINFER_MODEL=.``)
in a model's directory served it as ``"."``, and a client asking for the directory's name got a 404. It is now the
directory's own name.
"""

from __future__ import annotations

import pytest

from asyncinfer.server import ModelSpec


@pytest.mark.parametrize("typed", [".", "./", "sub/..", "../my-model", "../my-model/"])
def test_a_directory_typed_as_dot_is_served_by_its_name(tmp_path, monkeypatch, typed: str) -> None:
    (tmp_path / "my-model" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "my-model")
    assert ModelSpec.served_name(typed) == "my-model"
    monkeypatch.setenv("ASYNCINFER_MODEL", typed)
    assert ModelSpec.served_name(None) == "my-model"


def test_other_names_are_as_before(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "my.gguf").touch()
    assert ModelSpec.served_name("models/my.gguf") == "my"
    assert ModelSpec.served_name(str(tmp_path / "x.GGUF")) == "x"
    assert ModelSpec.served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert ModelSpec.served_name("/") == "/"
