"""``--help`` names every flag's value readably (N, SIZE, DTYPE, ...), never argparse's placeholder (the
destination upper-cased: ``--dtype ENGINE_DTYPE``); ``asyncinfer plan`` counts requests in the right number."""

from __future__ import annotations

from asyncinfer import cli
from tests.helpers import cli_commands


def test_every_flag_that_takes_a_value_has_a_readable_metavar() -> None:
    placeholders = []
    for name, parser in cli_commands().items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.choices is not None:
                continue  # on/off flags, and choices (shown as {a,b})
            if action.metavar is None:  # argparse would show the destination upper-cased
                placeholders.append(f"{name} {action.option_strings[-1]} {action.dest.upper()}")
    assert placeholders == []
    for name, parser in cli_commands().items():
        assert "ENGINE_" not in parser.format_help(), name


def test_the_engine_flags_metavars() -> None:
    text = cli_commands()["serve"].format_help()
    for shown in ("--dtype DTYPE", "--block-size N", "--kv-watermark FRACTION",
                  "--max-consecutive-step-failures N", "--activation-reserve SIZE", "--scheduler NAME"):
        assert shown in text, shown


def test_plan_counts_one_request_in_the_singular(tiny_models, capsys) -> None:
    path = str(tiny_models["llama"][0])
    cli.main(["plan", path, "--batch", "1", "--seq-len", "64", "--device-memory", "1GiB"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith(": 1 request x 64 tokens"), lines[1]
    cli.main(["plan", path, "--batch", "3", "--seq-len", "2", "--device-memory", "1GiB"])  # the engine's shortest
    assert capsys.readouterr().out.splitlines()[1].endswith(": 3 requests x 2 tokens")
