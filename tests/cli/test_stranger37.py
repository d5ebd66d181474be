"""A stranger's first hour (stranger37): ``asyncinfer plan --seq-len 1``.

docs/monitoring/README.md: "Started with the options it prints (... or the command with the flags of the next
line, ``asyncinfer serve --kv-cache-memory ...``), the engine loads those weights and allocates exactly that KV
cache". ``asyncinfer plan --seq-len 1`` planned, exit status 0, and printed ``--max-model-len 1`` among those flags,
which every command that loads refuses (``--max-model-len 1 is invalid: allowed an integer >= 2``): a length of 1
holds no prompt token and an output token. The plan refuses it as the engine does."""

from __future__ import annotations

import pytest

from asyncinfer import cli


def test_plan_refuses_a_length_the_engine_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--seq-len", "1"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: --seq-len 1 is invalid: allowed an integer >= 2 and <= 8192\n"
    assert cli.main(["info", "--threads", "1", "--max-model-len", "1"]) == 2  # what the printed flags met
    assert capsys.readouterr().err == "asyncinfer: error: --max-model-len 1 is invalid: allowed an integer >= 2\n"
    assert cli.main(["plan", "--seq-len", "2", "--device-memory", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "--max-model-len 2 " in out


def test_plan_never_offers_a_max_num_seqs_past_the_engine_s(capsys: pytest.CaptureFixture[str]) -> None:
    """``asyncinfer plan --batch 5000`` noted "plan with --max-num-seqs 5000 to run all 5000 at once", a flag the
    plan itself (and the engine) refuses: at most 4096."""
    assert cli.main(["plan", "--batch", "5000", "--seq-len", "64", "--device-memory", "64GiB"]) == 0
    note = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1]
    assert note == ("note: at most max_num_seqs=128 requests run in one step, the other 4872 wait; plan with "
                    "--max-num-seqs 4096 to run 4096 at once (the engine's most)")
    assert cli.main(["plan", "--batch", "5000", "--seq-len", "64", "--max-num-seqs", "5000"]) == 2
    assert "--max-num-seqs 5000 is invalid: allowed an integer >= 1 and <= 4096" in capsys.readouterr().err
    assert cli.main(["plan", "--batch", "5000", "--seq-len", "64", "--device-memory", "64GiB",
                     "--max-num-seqs", "4096"]) == 0
    assert capsys.readouterr().out.rstrip("\n").endswith("the other 904 wait; 4096 is the engine's most")
