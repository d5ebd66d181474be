"""``asyncinfer generate --prompt "$PROMPT"`` with the variable unset: the model was loaded, the engine refused the
empty prompt as the job's one error line and the job ended with status 1; chat refuses its empty prompt before
loading anything, and so do generate and embed now, naming the --prompt or the text."""

from __future__ import annotations

import pytest

from asyncinfer import cli


@pytest.mark.parametrize(("argv", "which"), [
    (["generate", "--prompt", ""], "--prompt ''"),
    (["generate", "--prompt", "hi", "--prompt", "", "--chat"], "--prompt number 2 of 2"),
])
def test_an_empty_prompt_is_refused_before_the_load(no_load, capsys, argv, which) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"asyncinfer: error: {which} is empty (an unset variable?): give the text of each prompt\n"


@pytest.mark.parametrize(("argv", "which"), [
    (["embed", ""], "the text ''"),
    (["embed", "a text", ""], "text number 2 of 2"),
])
def test_an_empty_text_to_embed_is_refused_before_the_load(no_load, capsys, argv, which) -> None:
    """``asyncinfer embed "$TEXT"`` with the variable unset loaded the encoder and printed the embedding of ''
    (status 0), where /v1/embeddings refuses an empty text."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"asyncinfer: error: {which} is empty (an unset variable?): give each text to embed\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--file", ""], "--file '' is invalid: allowed a file's path, or '-' for stdin"),
    (["generate", "--prompt", "hi", "--output", ""], "--output '' is invalid: allowed a file's path, or '-' for stdout"),
])
def test_an_empty_path_is_refused_naming_its_flag(no_load, capsys, argv, message) -> None:
    """``--file "$IN"`` or ``--output "$OUT"`` with the variable unset read "--file : No such file or directory"."""
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"asyncinfer: error: {message}\n"
