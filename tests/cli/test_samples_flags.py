"""``--n`` and ``--best-of`` (OpenAI's and vLLM's samples of one prompt) on the command line: no command has such a
flag, so each is refused naming where the number goes; argparse read ``--n`` as an abbreviation of the ``--no-...``
switches ("ambiguous option: --n could match --no-progress, ...") and ``--best-of`` got "did you mean --stop?"."""

from __future__ import annotations

import pytest

from asyncinfer import cli

_FILE_LINE = ("a line of asyncinfer generate --file sets ({\"prompt\": \"...\", \"n\": 2, \"temperature\": 0.8}: "
              "greedy, the default, gives n copies of one answer)")


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--prompt", "hi", "--n", "2"],
     f"--n is not a flag of asyncinfer generate: it is OpenAI's samples of one prompt, n, which {_FILE_LINE}"),
    (["chat", "hi", "--n=2"],
     f"--n is not a flag of asyncinfer chat: it is OpenAI's samples of one prompt, n, which {_FILE_LINE}"),
    (["serve", "--n", "2"],
     ("--n is not a flag of asyncinfer serve: it is OpenAI's samples of one prompt, n, which serve's requests set in "
      "their body (\"n\": 2, with a temperature)")),
    (["generate", "--prompt", "hi", "--best-of", "2"],
     ("--best-of is not a flag of asyncinfer generate: it is vLLM's best_of (candidates of which the n best are "
      f"returned); asyncinfer returns every sample it makes, n, which {_FILE_LINE}")),
])
def test_a_samples_flag_is_refused_naming_where_n_goes(no_load, capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"asyncinfer: error: {message}\n"


def test_a_prompt_after_dashes_that_reads_n_is_text() -> None:
    args = cli.build_parser().parse_args(["chat", "--", "--n"])
    assert args.prompt == ["--n"]
