"""stranger61, every command's flags against their ``--help``: ``generate --file`` ran a line whose prompt was no
prompt (``{"prompt": 5}``) and reported it only as that request's error, exit 1, where its help says every line is
checked before anything runs; an engine flag's text that is no number gave no range ("'abc' is not an integer");
``lab --save-trace`` into a missing directory was refused without its flag; ``plan --scheduler`` got argparse's
"did you mean --seq-len?"; ``--top-k``'s help said only 0 turns it off."""

from __future__ import annotations

import pytest

from asyncinfer import cli
from asyncinfer.prompts import CHAT_ROLES


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    return captured.err.removeprefix("asyncinfer: error: ").rstrip("\n")


NO_PROMPT = ("'prompt' must be a non-empty string, a non-empty list of token ids (integers >= 0) or a list of chat "
             "messages")
SURROGATE = "must be valid Unicode, not <a text with the lone surrogate"


@pytest.mark.parametrize(("line", "said"), [
    ('{"prompt": 5}', f"{NO_PROMPT}, not 5"),
    ('{"prompt": ""}', f'{NO_PROMPT}, not ""'),
    ('{"prompt": [1, -2]}', f"{NO_PROMPT}, not [1, -2]"),
    ('{"prompt": [1, true]}', f"{NO_PROMPT}, not [1, true]"),
    ('{"prompt": "a\\ud800"}', f"'prompt' {SURROGATE} '\\ud800' at index 1>"),
    ('{"messages": [{"role": "user", "content": "\\udc00"}]}', f"'messages[0]' {SURROGATE} '\\udc00' at index 0>"),
    ('{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}',
     f"'messages[0]' {SURROGATE} '\\ud800' at index 0>"),
    # by the engine's own rules (prompts.check_messages), not a copy: the copy let a role no model takes run
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}',
     f'messages[1].role="bot" is invalid: allowed one of {", ".join(map(repr, CHAT_ROLES))}'),
    ('{"prompt": [{"role": "user", "content": "hi"}, {"role": "user"}]}',
     "prompt[1]={\"role\": \"user\"} is invalid: allowed a dict with string 'role' and 'content'"),
])
def test_a_line_whose_prompt_no_model_takes_fails_the_job_before_the_load(line, said, tmp_path, no_load,
                                                                          capsys) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "fine"}\n' + line + "\n", encoding="utf-8")
    assert cli.main(["generate", "--file", str(lines), "--no-progress"]) == 2
    assert error_line(capsys) == f"{lines} line 2: {said}"


@pytest.mark.parametrize(("argv", "said"), [
    (["info", "--engine-seed", "x"], "'x' is not an integer: allowed an integer in [0, 9223372036854775807]"),
    (["info", "--max-num-seqs", "many"], "'many' is not an integer: allowed an integer in [1, 4096]"),
    (["info", "--kv-cache-fraction", "half"],
     "'half' is not a number: allowed a number in (0, 0.95], or none (from the workload)"),
])
def test_an_engine_flag_that_is_no_number_says_its_range(argv, said, capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert error_line(capsys) == f"argument {argv[1]}: {said}"


def test_a_save_trace_path_that_cannot_be_written_is_refused_by_its_flag_first(tmp_path, capsys) -> None:
    missing = tmp_path / "no-such-dir" / "t.jsonl"
    assert cli.main(["lab", "--synthetic", "3", "--save-trace", str(missing)]) == 2
    assert error_line(capsys) == (f"--save-trace {missing}: No such file or directory (the directory "
                                  f"{missing.parent} does not exist)")


@pytest.mark.parametrize(("command", "flag"), [(["plan"], "--scheduler"), (["plan"], "--no-enable-prefix-caching"),
                                               (["lab"], "--engine-seed"), (["embed", "hi"], "--max-num-seqs")])
def test_an_engine_flag_on_a_command_that_loads_no_engine_says_where_it_belongs(command, flag, capsys) -> None:
    argv = [command[0], flag, *(["1"] if not flag.startswith("--no-") else []), *command[1:]]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert error_line(capsys) == (f"{flag} is not a flag of asyncinfer {command[0]}: it is an engine option, a flag "
                                  "of the commands that load the engine (asyncinfer chat, generate, bench, info, "
                                  "serve)")


def test_top_k_help_names_both_values_that_turn_it_off(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["chat", "--help"])
    assert "keep the k most likely tokens (0 or -1: off)" in " ".join(capsys.readouterr().out.split())
