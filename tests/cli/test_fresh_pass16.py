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


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["serve"], ["plan"], ["info"], ["embed", "hi"],
                                  ["bench", "--num-requests", "1"], ["chat"]])
def test_an_empty_model_flag_is_refused_by_its_flag(tmp_path, capsys, monkeypatch, tiny_models, argv) -> None:
    """``-m "$MODEL"`` with the variable unset loaded the model of the working directory (``generate``, ``serve``,
    ``plan``, ``embed``, ...), ``Path("")`` being ``.``: refused before anything loads."""
    import shutil

    shutil.copytree(tiny_models["llama"][0], tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    try:
        status = cli.main([argv[0], "-m", "", *argv[1:]])
    except SystemExit as exited:
        status = exited.code
    assert status == 2
    assert capsys.readouterr().err == ("asyncinfer: error: --model '' is invalid: allowed a model directory, a .gguf "
                                       "file or a known name, not an empty string (leave --model out for the default "
                                       "model; . is the working directory)\n")
