"""pass31: ``asyncinfer generate --file`` with lines Python's JSON reader cannot take.

A line of arrays (or objects) nested some thousands deep ended the job as ``asyncinfer: internal error:
RecursionError: maximum recursion depth exceeded ...`` (exit status 1), where every other bad line is a usage
error naming its line (exit status 2); and a number of more than 4,300 digits was refused with Python's advice to
the programmer (``use sys.set_int_max_str_digits() to increase the limit``). Both name the line and what is wrong
with it now, before the model loads.
"""

from __future__ import annotations

import pytest

from asyncinfer import cli


def refusal(capsys, jobs) -> str:
    """What ``asyncinfer generate --file jobs`` says as it refuses them: status 2, one line, no traceback (the line
    without its prefix); the model is never loaded."""
    assert cli.main(["generate", "--file", str(jobs), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("asyncinfer: error: ").rstrip("\n")


@pytest.mark.parametrize("line", [
    '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"messages": [{"role": "user", "content": ' + "[" * 5000 + "]" * 5000 + "}]}",
    '{"prompt": "hi", "id": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
])
def test_a_line_nested_too_deeply_is_a_usage_error_naming_it(tmp_path, capsys, line) -> None:
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "fine"}\n' + line + "\n")
    said = refusal(capsys, jobs)
    assert said == f"{jobs} line 2: not JSON that can be read (arrays or objects nested too deeply)"


@pytest.mark.parametrize("line", ['{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
                                  '{"prompt": [' + "7" * 4301 + "]}", '{"prompt": "hi", "id": ' + "1" * 9000 + "}"])
def test_a_number_of_thousands_of_digits_is_refused_in_the_users_words(tmp_path, capsys, line) -> None:
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(line + "\n")
    said = refusal(capsys, jobs)
    assert said == f"{jobs} line 1: not JSON (a number of more than 4300 digits)"
    assert "set_int_max_str_digits" not in said
