"""A flag's value that is no number is refused naming the flag and what it takes (argparse's own message was
"argument --port: invalid int value: 'abc'": no range, where ``--port 70000`` named it)."""

from __future__ import annotations

import pytest

from asyncinfer import cli


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """``argv`` ends with status 2 (argparse's refusals exit, the commands' own return it) and ``message``."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.endswith(f"asyncinfer: error: {message}\n"), err


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
    refused(capsys, argv, message)


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--port", "70000"], "--port 70000 is not a TCP port (0 to 65535)"),
    (["plan", "--batch", "0"], "--batch 0 is invalid: allowed an integer >= 1 and <= 9223372036854775807"),
    (["chat", "--top-p", "2", "hi"], "--top-p 2 is invalid: allowed a number in (0, 1]"),
])
def test_a_number_out_of_range_is_refused_as_before(capsys, argv, message) -> None:
    refused(capsys, argv, message)


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--num-requests", "100000000000"], ("--num-requests 100000000000 is invalid: allowed an integer in "
                                                  "[1, 100000]")),
    (["bench", "--concurrency", "1,1000000"], ("--concurrency '1,1000000' is invalid: allowed comma-separated "
                                               "integers in [1, 100000], e.g. 1,4,16")),
    (["bench", "--num-requests", "many"], ("argument --num-requests: 'many' is not an integer: allowed an integer "
                                           "in [1, 100000]")),
    (["bench", "--output-len", "x"], "argument --output-len: 'x' is not an integer: allowed an integer >= 1"),
    (["generate", "--prompt", "hi", "--concurrency", "x"], ("argument --concurrency: 'x' is not an integer: "
                                                            "allowed an integer >= 1")),
])
def test_bench_takes_at_most_its_cap_of_requests(capsys, argv, message) -> None:
    """``bench --num-requests 100000000000`` made its prompts first: past 2.9 GB in 25 s, bound for the OOM
    killer. A run takes at most ``BENCH_MAX_REQUESTS`` requests, and a concurrency level no higher."""
    from asyncinfer.commands.bench import BENCH_MAX_REQUESTS

    assert BENCH_MAX_REQUESTS == 100_000
    refused(capsys, argv, message)
