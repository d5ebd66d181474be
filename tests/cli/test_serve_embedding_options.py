"""``asyncinfer serve --embedding-option KEY=VALUE``: the sentence encoder's options (max_busy_share, max_batch_size...)
reach the served model, and a bad one is refused by that flag before anything loads."""

from __future__ import annotations

from typing import Any

import pytest

import asyncinfer.server
from asyncinfer import cli


def test_the_options_reach_the_encoder_s_spec(tiny_models, minilm_dir, capsys, monkeypatch) -> None:
    made: list[Any] = []
    real = asyncinfer.server.create_app
    monkeypatch.setattr(asyncinfer.server, "create_app", lambda specs, settings: made.append(specs) or real(specs, settings))
    monkeypatch.setattr(asyncinfer.server, "run_server", lambda *args, **kwargs: None)
    assert cli.main(["serve", str(tiny_models["llama"][0]), "--port", "0", "--embedding-model", str(minilm_dir),
                     "--embedding-option", "max_busy_share=0.5", "--embedding-option", "max_batch_size=8"]) == 0
    [specs] = made
    assert dict(specs[1].options) == {"max_busy_share": 0.5, "max_batch_size": 8}
    assert "embedding model" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "error"), [
    (["--embedding-option", "max_busy_share=5"],
     "--embedding-option max_busy_share=5 is invalid: allowed a fraction of the engine thread's time in (0, 1]"),
    (["--embedding-option", "max_wait_ms=\"x\""],
     "--embedding-option max_wait_ms=\"x\" is invalid: allowed a number of milliseconds in [0, 1000]"),
    (["--embedding-option", "nope=1"], "--embedding-option nope=1 is invalid: allowed an embedding-model option: "),
    (["--embedding-option", "batch_invariant=1"],  # in JSON's words, as VALUE is read
     "--embedding-option batch_invariant=1 is invalid: allowed true or false"),
])
def test_a_bad_option_is_refused_by_the_flag(tiny_models, minilm_dir, capsys, flags, error) -> None:
    assert cli.main(["serve", str(tiny_models["llama"][0]), "--port", "0", "--embedding-model", str(minilm_dir),
                     *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("asyncinfer: error: " + error) and err.count("\n") == 1, err


def test_an_option_without_an_embedding_model_is_refused(tiny_models, capsys) -> None:
    assert cli.main(["serve", str(tiny_models["llama"][0]), "--port", "0", "--embedding-option",
                     "max_busy_share=0.5"]) == 2
    assert capsys.readouterr().err == ("asyncinfer: error: --embedding-option sets an option of --embedding-model's "
                                       "sentence encoder: give --embedding-model too\n")


def test_an_option_without_a_value_is_shown_an_encoder_s_example(capsys) -> None:
    """``--embedding-option max_batch_size`` (no ``=VALUE``) was told to write ``prefill_budget=64``, a scheduler's
    option, which that flag then refuses as no embedding-model option; the example is now one of an encoder's."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--port", "0", "--embedding-model", "all-MiniLM-L6-v2", "--embedding-option", "max_batch_size"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "asyncinfer: error: argument --embedding-option: 'max_batch_size' is not KEY=VALUE (e.g. max_batch_size=64)")


def test_a_scheduler_option_without_a_value_keeps_its_scheduler_example(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--port", "0", "--scheduler-option", "prefill_budget"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "asyncinfer: error: argument --scheduler-option: 'prefill_budget' is not KEY=VALUE (e.g. prefill_budget=64)")


@pytest.mark.parametrize("flag", ["--embedding-option", "--scheduler-option"])
def test_a_number_past_a_floats_range_is_refused_and_nan_is_text(flag, capsys) -> None:
    """``max_wait_ms=1e400``: Python's JSON reads it as inf, and the option's refusal showed ``Infinity``, a value
    nobody typed (and NaN or Infinity, which JSON has not, were read as numbers): a number past a float's range is
    refused by the flag as typed, and NaN/Infinity are VALUE's text."""
    from asyncinfer.commands.engine_flags import key_value

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--port", "0", "--embedding-model", "all-MiniLM-L6-v2", flag, "x=[1, 1e400]"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"asyncinfer: error: argument {flag}: x=1e400: the number is past a float's range (a nonzero magnitude from "
        f"about 4.9e-324 to 1.8e308)")
    assert [key_value(f"x={text}") for text in ("NaN", "-Infinity", "1e308", "0.0e-400", "-0.0", "5e-324")] == [
        ("x", "NaN"), ("x", "-Infinity"), ("x", 1e308), ("x", 0.0), ("x", -0.0), ("x", 5e-324)]


@pytest.mark.parametrize("flag", ["--embedding-option", "--scheduler-option"])
@pytest.mark.parametrize("number", ["1e-400", "-2.5E-999"])
def test_a_nonzero_number_below_a_floats_range_is_refused_as_typed(flag, number, capsys) -> None:
    """``max_batch_size=1e-400``: Python's JSON reads it as 0.0, passed on as 0 and refused as
    ``max_batch_size=0.0 is invalid``, a value nobody typed."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--port", "0", "--embedding-model", "all-MiniLM-L6-v2", flag, f"max_batch_size={number}"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"asyncinfer: error: argument {flag}: max_batch_size={number}: the number is past a float's range (a nonzero "
        f"magnitude from about 4.9e-324 to 1.8e308)")


def test_a_long_value_is_shown_cut_with_its_length(capsys) -> None:
    """A refused VALUE of 501 digits was shown whole (one of 5,000 made a 5,000-character error line)."""
    digits = "1" + "0" * 500
    assert cli.main(["serve", "--port", "0", "--scheduler", "fifo", "--scheduler-option",
                     f"prefill_budget={digits}"]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"asyncinfer: error: --scheduler-option prefill_budget={digits[:100]}...(501 characters) "
                           "is invalid: allowed "), line
    assert len(line) < 400


@pytest.mark.parametrize(("argv", "error"), [
    (["serve", "--port", "0", "--scheduler", "pd-split", "--scheduler-option", "prefill_budget=1e3"],
     "--scheduler-option prefill_budget=1e3 is invalid: allowed an integer >= 1"),
    (["serve", "--port", "0", "--embedding-model", "all-MiniLM-L6-v2", "--embedding-option", "max_wait_ms=1e4"],
     "--embedding-option max_wait_ms=1e4 is invalid: allowed a number of milliseconds in [0, 1000]"),
    (["lab", "--option", "pd-split.prefill_budget=1e3"],
     "--option pd-split.prefill_budget=1e3 is invalid: allowed an integer >= 1"),
], ids=["scheduler-option", "embedding-option", "lab"])
def test_a_refused_value_is_shown_as_typed(argv, error, capsys) -> None:
    """``1e3`` was shown as JSON read it, ``1000.0``, a value nobody typed."""
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "asyncinfer: error: " + error


@pytest.mark.parametrize(("options", "error"), [
    (["pd-split.prefill_budget=1e400"], ("--option 'pd-split.prefill_budget=1e400' is invalid: allowed a VALUE whose "
     "numbers are 0 or of a nonzero magnitude from about 4.9e-324 to 1.8e308")),
    (["pd-split.prefill_budget=64", "pd-split.prefill_budget=0"], ("--option 'pd-split.prefill_budget=0' is invalid: "
     "allowed each NAME.KEY once (pd-split.prefill_budget is given twice)")),
    (["pd-split.prefill_budget=NaN"], "--option pd-split.prefill_budget=NaN is invalid: allowed an integer >= 1"),
], ids=["past-a-float", "twice", "nan-is-text"])
def test_the_labs_options_are_read_as_the_scheduler_option_is(options, error, capsys) -> None:
    """``lab --option``: 1e400 ran as inf (shown as Infinity), a NAME.KEY given twice kept the last silently."""
    argv = ["lab"]
    for option in options:
        argv += ["--option", option]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "asyncinfer: error: " + error
