"""A fourteenth stranger's first hour on the command line: what misled, each held to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import cli


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("asyncinfer: error: ").rstrip("\n")


@pytest.mark.parametrize(("typed", "shown", "allowed"), [
    ("prefill_budget=x", "prefill_budget=x", "an integer >= 1"),  # as typed (it showed JSON's "x")
    ("prefill_budget=0", "prefill_budget=0", "an integer >= 1"),
])
def test_a_scheduler_s_own_refusal_names_the_flag(tiny_models, capsys, typed: str, shown: str, allowed: str) -> None:
    """``--scheduler pd-split --scheduler-option prefill_budget=x`` said ``prefill_budget='x' is invalid``: a name
    that is no flag, its value in Python's quotes. A keyword the scheduler does not take already named
    ``--scheduler-option``; a value its own check refuses names it the same way, as typed (VALUE read as JSON)."""
    path = str(tiny_models["llama"][0])
    assert cli.main(["generate", path, "--prompt", "hi", "--max-tokens", "1", "--max-model-len", "64",
                     "--scheduler", "pd-split", "--scheduler-option", typed]) == 2
    assert _error_line(capsys) == f"--scheduler-option {shown} is invalid: allowed {allowed}"
