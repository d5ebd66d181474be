"""A trace holds at most ``MAX_TRACE_REQUESTS`` requests, from ``--synthetic``, ``synthetic_trace`` or a JSONL file:
``lab --synthetic 100000000`` built some 46 GB of request objects (the OOM killer ended it, minutes in, with no word)."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError, cli, lab
from asyncinfer.lab import trace as trace_module


def test_synthetic_flag_past_the_cap_is_refused_naming_it(capsys) -> None:
    assert trace_module.MAX_TRACE_REQUESTS == cli.LAB_MAX_REQUESTS == 10**6
    with pytest.raises(SystemExit) as exited:
        cli.main(["lab", "--synthetic", "100000000"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith(
        "asyncinfer: error: argument --synthetic: 100000000 is not in [1, 1000000]\n")


@pytest.mark.parametrize("count", [0, 10**6 + 1, 10**8, True, 2.0])
def test_synthetic_trace_takes_one_to_the_cap(count) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        lab.synthetic_trace(count)
    assert (refused.value.parameter, refused.value.allowed) == ("num_requests", "an integer in [1, 1000000]")


def test_a_trace_file_past_the_cap_is_refused_at_its_first_line_too_many(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(trace_module, "MAX_TRACE_REQUESTS", 3)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"arrival": {i}, "prompt_len": 4, "output_len": 2}}\n\n' for i in range(5)))
    with pytest.raises(InvalidParameterError) as refused:
        lab.load_trace(path)
    assert refused.value.parameter == "trace"
    assert refused.value.allowed == "at most 3 request lines (line 7 is one more)"
    path.write_text("".join(f'{{"arrival": {i}, "prompt_len": 4, "output_len": 2}}\n' for i in range(3)))
    assert [r.id for r in lab.load_trace(path)] == ["r1", "r2", "r3"]
