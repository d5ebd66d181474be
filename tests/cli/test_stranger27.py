"""A newcomer's first hour (stranger 27): ``asyncinfer chat "$PROMPT"`` with the variable unset or blank loaded the
model and sent an empty message, and the model answered it ("I'm here to help you with whatever"), status 0, where a
session's empty line sends nothing. The empty one-shot prompt is refused in one line (status 2), before the model
loads (the model given here does not exist: the error is about the prompt)."""

from __future__ import annotations

import pytest

from asyncinfer import cli


@pytest.mark.parametrize("words", [[""], ["  "], ["", "\t"]])
def test_an_empty_one_shot_prompt_is_refused_before_the_model_loads(words, capsys) -> None:
    assert cli.main(["chat", *words, "--model", "/no/such/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "is empty (an unset variable?): give the message, or omit the prompt for an interactive session" in err
    assert "does not exist" not in err


def test_a_prompt_with_spaces_around_it_is_still_a_prompt(capsys) -> None:
    assert cli.main(["chat", " hi ", "--model", "/no/such/model.gguf"]) == 2
    assert "does not exist" in capsys.readouterr().err  # it went on to load the model
