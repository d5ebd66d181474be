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
