"""A forty-fourth stranger's first hour with the schedulers: what misled, each held to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError, cli
from asyncinfer.schedulers import available_schedulers, resolve_scheduler


@pytest.mark.parametrize(("typed", "meant"), [
    ("length_bucket", "length-bucket"),   # Python's spelling of the name
    ("pd_split", "pd-split"),
    ("FIFO", "fifo"),
    ("Aging_Priority", "aging-priority"),
    ("aging priority", "aging-priority"),
    ("pd-splt", "pd-split"),               # a typo
])
def test_an_unknown_scheduler_name_close_to_one_names_it(typed: str, meant: str) -> None:
    """``scheduler="length_bucket"`` (or ``--scheduler FIFO``) listed the names, none marked, where every other
    misspelt option or flag gets "did you mean ...?"."""
    with pytest.raises(InvalidParameterError) as info:
        resolve_scheduler(typed)
    assert info.value.parameter == "scheduler"
    assert str(info.value) == (f"scheduler={typed!r} is invalid: allowed one of {available_schedulers()} or "
                               f"'module:Class'; did you mean {meant!r}?")


def test_a_name_close_to_none_lists_the_names_only() -> None:
    with pytest.raises(InvalidParameterError) as info:
        resolve_scheduler("round-robin")
    assert str(info.value) == f"scheduler='round-robin' is invalid: allowed one of {available_schedulers()} or 'module:Class'"


def test_the_commands_say_it_in_their_flags_terms(capsys) -> None:
    assert cli.main(["lab", "--synthetic", "3", "--schedulers", "fifo,pd_split"]) == 2
    err = capsys.readouterr().err
    assert err == (f"asyncinfer: error: --schedulers 'pd_split' is invalid: allowed one of {available_schedulers()} or "
                   "'module:Class'; did you mean 'pd-split'?\n")


def _refusing_class():
    """A plugin whose constructor refuses an option with a plain ValueError, not the contract's InvalidParameterError."""
    from asyncinfer.schedulers.fifo import FIFOScheduler

    class Picky(FIFOScheduler):
        def __init__(self, config, kv, weight: int = 1) -> None:
            if weight <= 0:
                raise ValueError("weight must be positive")
            super().__init__(config, kv)

    return Picky


def test_the_conformance_suite_names_a_constructor_that_refuses_with_its_own_error() -> None:
    """``check_scheduler(Picky, {"weight": -1})`` let the plugin's ValueError through as raised, unlike the lab
    (a broken contract, its error chained) and the engine (the options' InvalidParameterError)."""
    from asyncinfer.conformance import check_scheduler
    from asyncinfer.schedulers.testing import ContractViolation

    picky = _refusing_class()
    with pytest.raises(ContractViolation) as info:
        check_scheduler(picky, {"weight": -1}, engine=False)
    assert str(info.value) == ("Picky cannot be constructed as the engine constructs it (scheduler(config, kv, "
                               "**options)): its constructor raised ValueError: weight must be positive with options "
                               "{'weight': -1} (a bad option is an InvalidParameterError naming it)")
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(InvalidParameterError):  # an option it does not take: named by the registry, as before
        check_scheduler(picky, {"wieght": 1}, engine=False)


def test_the_lab_shows_no_tpot_as_a_dash_and_says_why(capsys, tmp_path) -> None:
    """``lab --synthetic 5 --max-model-len 10``: every request ends after one token, so there is no TPOT. The
    table printed ``nan``, the JSON file ``NaN`` (not JSON), and the trace line the trace's 476 output tokens as if
    they were produced."""
    import json

    out_file = tmp_path / "lab.json"
    assert cli.main(["lab", "--synthetic", "5", "--max-model-len", "10", "--schedulers", "fifo",
                     "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out
    assert "(5 requests, 45 prompt and 476 output tokens; 5 produced: each request ends at --max-model-len 10)" in out
    row = next(line for line in out.splitlines() if line.startswith("fifo"))
    assert row.split()[4:6] == ["-", "-"]  # TPOT p50, p99
    assert out.rstrip().endswith("TPOT -: no request produced two or more output tokens (TPOT is the time per token "
                                 "after the first)")
    summary = json.loads(out_file.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert summary["summaries"][0]["tpot_p50"] is None and summary["summaries"][0]["output_tokens"] == 5
