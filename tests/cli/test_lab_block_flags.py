"""The lab's KV flags take the ranges they can run: ``--block-size`` the engine's ``block_size`` (1 to 256; 100000000
ran, every figure nonsense), ``--num-blocks`` at most ``LAB_MAX_BLOCKS`` (the lab builds a Python object per block:
``--num-blocks 1000000000`` died of ``MemoryError``), a ``--max-model-len`` no ``--num-blocks`` can hold is refused
as itself, and a value that is no integer is refused naming the flag and the range (argparse's own message named
the parsing function: ``invalid _positive_int value: 'abc'``)."""

from __future__ import annotations

import pytest

from asyncinfer import cli


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-blocks", "1000000000"], "argument --num-blocks: 1000000000 is not in [1, 1048576]"),
    (["--num-blocks", "abc"], "argument --num-blocks: 'abc' is not an integer in [1, 1048576]"),
    (["--block-size", "257"], "argument --block-size: 257 is not in [1, 256] (the engine's block_size)"),
    (["--block-size", "1e3"], "argument --block-size: '1e3' is not an integer in [1, 256] (the engine's block_size)"),
    (["--synthetic", "x"], "argument --synthetic: 'x' is not an integer in [1, 1000000]"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: 'many' is not an integer >= 1"),
    (["--max-model-len", "99999999999999999999"], ("--max-model-len 99999999999999999999 is invalid: allowed at most "
     "16777216, the tokens of --num-blocks' largest, 1048576 blocks of --block-size 16")),
])
def test_lab_kv_flags_are_refused_in_their_own_terms(capsys, argv, message) -> None:
    try:  # argparse's refusals exit; the command's own return the status
        status = cli.main(["lab", "--synthetic", "3", *argv])
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith(f"asyncinfer: error: {message}\n"), err


def test_lab_runs_at_the_largest_block_size_and_count(capsys) -> None:
    assert cli.main(["lab", "--synthetic", "3", "--schedulers", "fifo", "--block-size", "256",
                     "--num-blocks", "16", "--max-model-len", "4096"]) == 0
    assert "16 blocks x 256" in capsys.readouterr().out


@pytest.mark.parametrize(("keyword", "value", "allowed"), [
    ("num_blocks", 10**9, "an integer in [1, 1048576]"),
    ("num_blocks", 0, "an integer in [1, 1048576]"),
    ("block_size", 10**8, "an integer in [1, 256]"),
])
def test_lab_simulate_takes_the_flags_ranges_in_python_too(keyword, value, allowed) -> None:
    """``lab.simulate(num_blocks=10**9)`` built a block object each (some 200 GB) before anything was checked."""
    from asyncinfer import InvalidParameterError, lab
    from asyncinfer.lab.simulator import MAX_SIM_BLOCKS

    assert MAX_SIM_BLOCKS == cli.LAB_MAX_BLOCKS
    trace = lab.synthetic_trace(4, seed=0)
    with pytest.raises(InvalidParameterError) as refused:
        lab.simulate(trace, "fifo", **{keyword: value})
    assert (refused.value.parameter, refused.value.value, refused.value.allowed) == (keyword, value, allowed)
