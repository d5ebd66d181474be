"""A forty-fourth stranger's first hour with the command line and the scheduler plugins: what misled, each held
to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import cli


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


@pytest.mark.parametrize(("module", "dotted", "where"), [
    ("examples/custom_scheduler.py", "examples.custom_scheduler", "examples"),
    ("./examples/custom_scheduler.py", "examples.custom_scheduler", "examples"),
    ("examples\\custom_scheduler", "examples.custom_scheduler", "examples"),
    ("s44_no_such_policies.py", "s44_no_such_policies", "it"),
])
def test_lab_plugin_given_as_a_file_names_the_dotted_module(capsys, module: str, dotted: str, where: str) -> None:
    """``asyncinfer lab --plugin examples/custom_scheduler.py``, the example's file as a shell completes it, said
    ``No module named 'examples/custom_scheduler'`` (a leading ``./``: "an absolute module name"), where
    ``--scheduler`` given a file's path shows the dotted name it means."""
    assert cli.main(["lab", "--plugin", module, "--list-schedulers"]) == 2
    assert _error_line(capsys) == (
        f"asyncinfer: error: --plugin={module!r} is invalid: allowed an importable module: a module's dotted name, "
        f"not a file's path (here {dotted}, run from the directory that holds {where})")
