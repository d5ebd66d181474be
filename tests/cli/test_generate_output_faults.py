"""pass67: two ways ``asyncinfer generate`` ran every request and then died with an internal error at the first
write, its other lines' results lost: a ``--file`` line whose ``"id"`` holds a lone surrogate (written back in the
output, which UTF-8 cannot hold), and standard output closed (``>&-``). Both are refused before the load now, one
line, exit 2."""

from __future__ import annotations

import sys

from asyncinfer import cli


def test_an_id_that_is_not_valid_unicode_fails_the_job_before_the_load(tmp_path, no_load, capsys) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "hello", "max_tokens": 2}\n{"prompt": "hi", "id": "a\\ud800", "max_tokens": 2}\n',
                     encoding="utf-8")
    assert cli.main(["generate", "--file", str(lines), "--no-progress", "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err == (f"asyncinfer: error: {lines} line 2: 'id' must be valid Unicode, not <a string with the lone "
                   "surrogate '\\ud800' at index 1>\n")
    assert not (tmp_path / "out.jsonl").exists()


def test_closed_standard_output_is_refused_before_the_load(tmp_path, no_load, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdout", None)  # what Python holds when started with it closed
    assert cli.main(["generate", "--prompt", "hi", "--no-progress"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: --output -: standard output is closed: give --output FILE\n"
