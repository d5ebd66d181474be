"""pass44: a command's MODEL given as an empty string, and a file-derived name refused for ASYNCINFER_MODEL's model.

``asyncinfer serve "$MODEL_DIR"`` with the variable unset (or empty) gives MODEL as ``""``: the commands read it as no
MODEL (``args.model_arg or args.model``) and loaded the default model instead, ``serve`` serving SmolLM2 where the
user had named a model of their own, ``info`` and ``plan`` describing it, ``generate "" --prompt hi`` answering with
it; ``--model ""`` was refused ("not an empty string (leave --model out for the default model ...)"). MODEL is now
refused the same way, before anything is planned or loaded.

``serve`` refuses a model whose file or directory name is no valid model name before the plan, "naming where the name
came from" (pass43); with no MODEL, the model ``ASYNCINFER_MODEL`` names, the message said "the model would be served
as ..." with no word of the variable, the only place the user had named it. It says ``ASYNCINFER_MODEL's model``.
And that check came before the plan had found the model: a mistyped path past 200 characters in its last part was
refused as a name to choose with ``--served-model-name``, not as the path that does not exist.
"""

from __future__ import annotations

import pytest

from asyncinfer import cli, model_source


@pytest.fixture
def no_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model must not be reached: an empty MODEL loaded it."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the default model was resolved for an empty MODEL")

    monkeypatch.setattr(model_source, "default_model_path", refused)
    monkeypatch.delenv("ASYNCINFER_MODEL", raising=False)


@pytest.mark.parametrize("argv", [
    ["info", "", "--threads", "1"], ["plan", "", "--device-memory", "1GiB"], ["serve", "", "--port", "0"],
    ["generate", "", "--prompt", "hi", "--max-tokens", "1"], ["bench", " ", "--num-requests", "1", "--threads", "1"],
])
def test_an_empty_model_argument_is_refused_not_the_default_model(no_default_model, capsys, argv) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err == (f"asyncinfer: error: MODEL {argv[1]!r} is invalid: allowed a model directory, a .gguf file or a "
                   "known name, not an empty string (leave MODEL out for the default model; . is the working "
                   "directory)\n"), (out, err)
    assert out == ""


def test_asyncinfer_model_with_an_invalid_file_name_is_named(tmp_path, tiny_models, monkeypatch, capsys) -> None:
    path = tmp_path / ("m" * 230)
    path.symlink_to(tiny_models["llama"][0])
    monkeypatch.setenv("ASYNCINFER_MODEL", str(path))
    assert cli.main(["serve", "--port", "0", "--threads", "1"]) == 2
    out, err = capsys.readouterr()
    assert "serving" not in out and err.count("\n") == 1, (out, err)
    assert err.startswith("asyncinfer: error: ASYNCINFER_MODEL's model would be served as 'mmm"), err
    assert "--served-model-name" in err
    assert cli.main(["serve", str(path), "--port", "0", "--threads", "1"]) == 2  # a MODEL typed: "the model"
    assert capsys.readouterr().err.startswith("asyncinfer: error: the model would be served as 'mmm")


def test_a_mistyped_long_path_is_a_path_that_does_not_exist_not_a_name_to_give(tmp_path, capsys) -> None:
    """A path past 200 characters in its last part that does not exist (a typo; a sentence given as MODEL) was
    refused as a name to choose with --served-model-name, which then met "does not exist"; the name is checked once
    the plan has found the model."""
    missing = tmp_path / ("x" * 220)
    assert cli.main(["serve", str(missing), "--port", "0", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncinfer: error: model path '{missing}' does not exist"), err
    assert "--served-model-name" not in err
