"""A sixteenth adversarial pass over the command line: each finding held to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import cli


@pytest.mark.parametrize("threads", ["0", "-1", "5000"])
def test_labs_calibration_threads_are_named_by_their_flag(tmp_path, capsys, tiny_models, threads) -> None:
    """``asyncinfer lab --calibrate OUT -m MODEL -t 0`` said "num_threads=0 is invalid", the engine option's
    name, where every other lab error names its flag; nothing is written."""
    out = tmp_path / "cost.json"
    status = cli.main(["lab", "--calibrate", str(out), "-m", str(tiny_models["llama"][0]), "-t", threads])
    assert status == 2 and not out.exists()
    assert capsys.readouterr().err == (f"asyncinfer: error: --threads {threads} is invalid: allowed an integer in "
                                       "[1, 4096]\n")
