"""A newcomer's first hour with the command line (stranger 52): sizes and counts past any machine's."""

from __future__ import annotations

import pytest

from asyncinfer import cli
from asyncinfer.config import MAX_BYTES
from asyncinfer.errors import InvalidParameterError
from asyncinfer.memory import MiB, read_model_config
from asyncinfer.planner import parse_bytes, plan_deployment

HUGE = str(10**400)


def test_a_size_is_read_exactly_and_bounded() -> None:
    """A byte count was read through a float: 99999999999999999999999 became 99999999999999991611392 in the
    refusal that followed, and a count of 400 digits became infinity, an OverflowError out of every size flag
    (``--kv-cache-memory``, ``--activation-reserve``, serve's ``--max-body-bytes``, plan's ``--device-memory``)."""
    assert parse_bytes("99999999") == 99999999
    assert parse_bytes("1.5GiB") == 3 * 512 * MiB
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES
    for text in (str(MAX_BYTES + 1), "99999999999999999999999", "9999999999TiB", HUGE):
        with pytest.raises(InvalidParameterError) as caught:
            parse_bytes(text)
        assert caught.value.value == text


@pytest.mark.parametrize("argv", [
    ["info", "--kv-cache-memory", HUGE], ["info", "--activation-reserve", HUGE],
    ["serve", "--max-body-bytes", HUGE], ["chat", "--kv-cache-memory", "99999999999999999999999", "hi"],
])
def test_a_huge_size_flag_is_refused_in_one_line(argv, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2
    assert err.startswith(f"asyncinfer: error: argument {argv[1]}: {argv[2]!r} is not a size (a byte count up to "
                          "2**63 - 1, or e.g. 512MiB, 2GiB, 4GB)") and err.count("\n") == 1, err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--batch", HUGE, f"--batch {HUGE} is invalid: allowed an integer >= 1 and <= {MAX_BYTES}"),
    ("--max-num-batched-tokens", HUGE,
     f"--max-num-batched-tokens {HUGE} is invalid: allowed an integer >= 1 and <= {MAX_BYTES}"),
    ("--device-memory", "99999999999999999999",
     f"--device-memory '99999999999999999999' is invalid: allowed a size of at most {MAX_BYTES} bytes (2**63 - 1)"),
])
def test_plan_refuses_a_count_past_any_budget(tiny_models, flag, value, message, capsys) -> None:
    """``asyncinfer plan --batch 10**400`` (or ``--max-num-batched-tokens``, ``--device-memory``) ended in
    ``internal error: OverflowError: integer division result too large for a float``, exit status 1."""
    status = cli.main(["plan", str(tiny_models["llama"][0]), flag, value, "--device-memory", "1GiB"]
                      if flag != "--device-memory" else ["plan", str(tiny_models["llama"][0]), flag, value])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == f"asyncinfer: error: {message}\n"


def test_plan_deployment_refuses_a_device_memory_past_any_budget(tiny_models) -> None:
    config = read_model_config(tiny_models["llama"][0])
    with pytest.raises(InvalidParameterError) as caught:
        plan_deployment(config, device_memory=10**400)
    assert (caught.value.parameter, caught.value.allowed) == ("device_memory", f"a byte count in [0, {MAX_BYTES}]")
    assert plan_deployment(config, batch=MAX_BYTES, max_num_batched_tokens=MAX_BYTES, device_memory=MAX_BYTES).fits is False


@pytest.mark.parametrize(("flag", "value", "instead"), [
    ("--trace", "", "a synthetic trace"), ("--cost-model", "", "the shipped one"), ("--cost-model", " ", "the shipped one"),
])
def test_lab_refuses_an_empty_file_to_read(flag, value, instead, capsys) -> None:
    """``asyncinfer lab --trace ''`` (an unset shell variable, say) replayed a synthetic trace as if no --trace were
    given, exit status 0; ``--cost-model ''`` said ``--cost-model : Is a directory``."""
    status = cli.main(["lab", flag, value, "--schedulers", "fifo"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == (f"asyncinfer: error: {flag} {value!r} is invalid: allowed a file's path "
                            f"(leave {flag} out for {instead})\n")
