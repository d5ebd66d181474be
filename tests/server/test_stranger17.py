"""``asyncinfer serve``, a newcomer's mistakes (stranger 17): refused in one line, by the flag, before a load."""

from __future__ import annotations

import pytest

import asyncinfer.server
from asyncinfer import cli


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(asyncinfer.server, "create_app", refuse)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_embedding_model_is_refused(tiny_models, capsys, no_load, value: str) -> None:
    """``--embedding-model "$EMBEDDER"`` with the variable unset served no embedding model, quietly: every
    /v1/embeddings call then answered 404. ``--model ''`` is refused the same way."""
    generator = str(tiny_models["llama"][0])
    assert cli.main(["serve", generator, "--port", "0", "--embedding-model", value]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: --embedding-model {value!r} is invalid: allowed a sentence encoder's name or directory, "
        "e.g. all-MiniLM-L6-v2, not an empty string (leave --embedding-model out to serve no embedding model)\n")


def test_a_missing_embedding_model_is_named_by_its_flag(tiny_models, tmp_path, capsys, no_load) -> None:
    """A missing ``--embedding-model`` path read ``model path '...' does not exist``, as if the served model were
    missing."""
    generator = str(tiny_models["llama"][0])
    missing = str(tmp_path / "encoder")
    assert cli.main(["serve", generator, "--port", "0", "--embedding-model", missing]) == 2
    assert capsys.readouterr().err.startswith(
        f"asyncinfer: error: --embedding-model {missing!r}: model path {missing!r} does not exist")
