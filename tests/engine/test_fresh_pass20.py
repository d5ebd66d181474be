"""A twentieth adversarial pass (engine side and the policy lab): each finding held to its fix."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.lab import load_cost_model, load_trace

GOOD_LINE = b'{"arrival": 0, "prompt_len": 10, "output_len": 4}\n'


@pytest.mark.parametrize(("line", "why"), [
    (b'{"arrival": 0, "prompt_len": 10, "output_len": 4, "id": "\xff"}\n', "not UTF-8"),
    (b"[" * 100_000 + b"\n", "nested"),
])
def test_a_hostile_trace_line_is_refused_by_its_line(tmp_path: Path, line: bytes, why: str) -> None:
    """A trace line that is not UTF-8 text, or JSON nested past Python's recursion limit, was the CLI's
    "internal error: UnicodeDecodeError" / "RecursionError" (no line named): now the trace's own refusal
    naming the line, as for any other line that is no request."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD_LINE + line)
    with pytest.raises(InvalidParameterError) as err:
        load_trace(path)
    assert err.value.parameter == "trace" and err.value.value == f"{path}:2", why
    assert why in str(err.value)


@pytest.mark.parametrize(("text", "why"), [
    (b"\xff", "not UTF-8"),
    (b"not json", "not JSON"),
    (b"[" * 100_000, "nested"),
    (b'{"coefficients": {"const": "x"}}', "numbers"),
    (b'{"coefficients": {"const": NaN}}', "finite"),
    (b'{"coefficients": {"const": 1e999}}', "finite"),
    (b'{"coefficients": {"tokens": Infinity}}', "finite"),
    (b'{"coefficients": {"tokens": true}}', "numbers"),
])
def test_a_hostile_cost_model_is_refused(tmp_path: Path, text: bytes, why: str) -> None:
    """A cost-model file that is not UTF-8, not JSON, nested too deep or with a coefficient that is no number was
    the CLI's "internal error"; a NaN or infinite coefficient was taken, and every figure of the lab's table read
    nan or inf (the SLO "0% met"), with no word of why."""
    path = tmp_path / "cost.json"
    path.write_bytes(text)
    with pytest.raises(InvalidParameterError) as err:
        load_cost_model(path)
    assert err.value.parameter in ("cost_model", "coefficients"), err.value
    assert why in str(err.value)


def test_a_finite_cost_model_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text('{"coefficients": {"const": 0.001, "tokens": 0}, "model": "m"}', encoding="utf-8")
    model = load_cost_model(path)
    assert model.coefficients == {"const": 0.001, "tokens": 0.0} and model.meta == {"model": "m"}
    assert math.isfinite(load_cost_model().coefficients["const"])


def test_the_lab_command_names_the_trace_line_and_the_cost_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the CLI printed was ``asyncinfer: internal error: UnicodeDecodeError: ...`` (and the same for a cost
    model that is not JSON), read as asyncinfer's own bug; now its one-line refusal, status 2."""
    from asyncinfer import cli

    trace = tmp_path / "t.jsonl"
    trace.write_bytes(GOOD_LINE + b"\xff\n")
    assert cli.main(["lab", "--trace", str(trace)]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: --trace {trace} line 2: expected a JSON object with arrival, prompt_len, output_len[, "
        "priority, id] (not UTF-8 text: byte 0xff at 0)\n")
    cost = tmp_path / "cost.json"
    cost.write_text("not json", encoding="utf-8")
    assert cli.main(["lab", "--synthetic", "5", "--cost-model", str(cost)]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: --cost-model {str(cost)!r} is invalid: allowed a JSON object with a 'coefficients' "
        "object (not JSON: Expecting value: line 1 column 1 (char 0))\n")


@pytest.mark.parametrize(("flag", "value", "shown"), [("--slo-ttft", "nan", "nan"), ("--slo-tpot", "-1", "-1"),
                                                      ("--slo-ttft", "0", "0"), ("--slo-tpot", "-0.5", "-0.5")])
def test_an_slo_that_no_request_can_meet_is_refused(capsys: pytest.CaptureFixture[str], flag: str, value: str,
                                                    shown: str) -> None:
    """``--slo-ttft nan`` or a bound <= 0 was taken, and every policy's row read "0%" met, as if all had failed."""
    from asyncinfer import cli

    assert cli.main(["lab", "--synthetic", "5", "--schedulers", "fifo", flag, value]) == 2
    assert capsys.readouterr().err == f"asyncinfer: error: {flag} {shown} is invalid: allowed seconds > 0 (inf: no bound)\n"


def test_an_slo_of_inf_is_no_bound() -> None:
    from asyncinfer.lab import Slo, simulate, summarize, synthetic_trace

    records = simulate(synthetic_trace(5, seed=0), "fifo").records
    assert summarize("fifo", records, Slo(ttft=math.inf, tpot=math.inf)).slo_attained == 1.0
    with pytest.raises(InvalidParameterError, match="slo_ttft=nan"):
        Slo(ttft=math.nan)
