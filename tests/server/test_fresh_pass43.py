"""pass43: the name ``asyncinfer serve`` serves a model under after its path.

docs/serving.md says ``asyncinfer serve`` names a model after its file (without ``.gguf``) or directory; but the name
was the last part of the path as typed, so ``asyncinfer serve .`` (or ``./``, ``models/..``, ``ASYNCINFER_MODEL=.``)
in a model's directory served it as ``"."``, and a client asking for the directory's name got a 404. It is now the
directory's own name.

A file or directory name that is no valid model name (past 200 characters, or not UTF-8) was refused by
``create_app`` after the plan was printed, as ``models[0].name='...' is invalid``: a name nobody gave, no word of
``--served-model-name``. ``serve`` refuses it before anything is planned, saying where it came from and how to name
the model.
"""

from __future__ import annotations

import pytest

from asyncinfer import cli
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


@pytest.mark.parametrize("link", ["m" * 230, "caf\udce9"])  # a long name; Latin-1 bytes, read as a lone surrogate
def test_a_path_whose_name_is_no_model_name_is_refused_before_the_plan(tmp_path, tiny_models, capsys, link) -> None:
    path = tmp_path / link
    path.symlink_to(tiny_models["llama"][0])
    assert cli.main(["serve", "--model", str(path), "--port", "0", "--threads", "1"]) == 2
    out, err = capsys.readouterr()
    assert "serving" not in out and err.count("\n") == 1, (out, err)
    assert "its file or directory name" in err and "--served-model-name" in err, err
    embedding = ["serve", "--model", str(tiny_models["llama"][0]), "--embedding-model", str(path), "--port", "0"]
    assert cli.main(embedding) == 2
    assert "--embedding-model" in capsys.readouterr().err
