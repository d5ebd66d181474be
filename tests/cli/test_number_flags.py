"""A flag's value that is no number is refused naming the flag and what it takes (argparse's own message was
"argument --port: invalid int value: 'abc'": no range, where ``--port 70000`` named it)."""

from __future__ import annotations

import pytest

from asyncinfer import cli


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--port", "abc"], "argument --port: 'abc' is not an integer: allowed a TCP port (0 to 65535)"),
    (["serve", "--max-connections", "many"], ("argument --max-connections: 'many' is not an integer: allowed an "
                                             "integer >= 1")),
    (["serve", "--max-requests-per-tenant", "1.5"], ("argument --max-requests-per-tenant: '1.5' is not an integer: "
                                                    "allowed an integer >= 1")),
    (["serve", "--body-timeout", "soon"], ("argument --body-timeout: 'soon' is not a number: allowed a finite number "
                                          "of seconds > 0")),
    (["plan", "--batch", "abc"], "argument --batch: 'abc' is not an integer: allowed an integer >= 1"),
    (["plan", "--max-num-seqs", "x"], ("argument --max-num-seqs: 'x' is not an integer: allowed an integer in "
                                      "[1, 4096]")),
    (["lab", "--rate", "fast"], ("argument --rate: 'fast' is not a number: allowed a finite number of requests per "
                                "second > 0")),
    (["lab", "--slo-tpot", "x"], "argument --slo-tpot: 'x' is not a number: allowed seconds > 0 (inf: no bound)"),
    (["embed", "--threads", "two", "a text"], ("argument --threads: 'two' is not an integer: allowed an integer in "
                                              "[1, 4096]")),
    # the sampling flags' ranges, read from SamplingParams' own refusal
    (["chat", "--top-k", "x", "hi"], ("argument --top-k: 'x' is not an integer: allowed 0 or -1 (disabled), or an "
                                     "integer >= 1")),
    (["generate", "--max-tokens", "1e3", "hi"], ("argument --max-tokens: '1e3' is not an integer: allowed an "
                                                "integer >= 1")),
    (["chat", "--top-p", "most", "hi"], "argument --top-p: 'most' is not a number: allowed a number in (0, 1]"),
])
def test_a_flag_value_that_is_no_number_is_refused_with_the_flags_range(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"asyncinfer: error: {message}\n"), err


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--port", "70000"], "--port 70000 is not a TCP port (0 to 65535)"),
    (["plan", "--batch", "0"], "--batch 0 is invalid: allowed an integer >= 1"),
    (["chat", "--top-p", "2", "hi"], "--top-p 2 is invalid: allowed a number in (0, 1]"),
])
def test_a_number_out_of_range_is_refused_as_before(capsys, argv, message) -> None:
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    assert capsys.readouterr().err.endswith(f"asyncinfer: error: {message}\n")
