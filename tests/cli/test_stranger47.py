"""``--plot`` of ``bench`` and ``lab``: a file name matplotlib cannot write is refused before the run, and the
file a name without a suffix becomes is the one the command names."""

from __future__ import annotations

import pytest

from asyncinfer import cli

pytest.importorskip("matplotlib")

from matplotlib.backend_bases import FigureCanvasBase

# what the installed matplotlib writes (".avif, .eps, ..., .png, ..., .svg, ..." with 3.10): the list depends on
# its version, which a fresh install may move
FORMATS = ", ".join(f".{ext}" for ext in sorted(FigureCanvasBase.get_supported_filetypes()))
assert {".png", ".svg", ".pdf"} <= set(FORMATS.split(", "))


def test_bench_refuses_a_plot_format_matplotlib_cannot_write_before_it_runs(tmp_path, capsys, monkeypatch) -> None:
    """``asyncinfer bench --plot out.txt`` ran every concurrency level and then ended in ``internal error:
    ValueError: Format 'txt' is not supported`` (exit status 1), the table printed and no plot."""
    from asyncinfer.commands import bench

    def no_run(*args, **kwargs):  # the benchmark must not start
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench, "_bench_engine", no_run)
    path = str(tmp_path / "out.txt")
    status = cli.main(["bench", "--num-requests", "1", "--concurrency", "1", "--plot", path])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == (f"asyncinfer: error: --plot {path!r} is invalid: allowed a file name ending in a format "
                            f"matplotlib writes: {FORMATS}\n")


def test_lab_refuses_a_plot_format_or_an_output_directory_before_it_runs(tmp_path, capsys) -> None:
    """The lab replayed the trace, printed its table and then failed the same way (and on a --json or --plot in
    a directory that does not exist)."""
    path = str(tmp_path / "out.txt")
    assert cli.main(["lab", "--synthetic", "20", "--plot", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"asyncinfer: error: --plot {path!r} is invalid: allowed a file name ending in a format "
                            f"matplotlib writes: {FORMATS}\n")
    for flag in ("--json", "--plot"):
        missing = tmp_path / "missing" / "figures.png"
        assert cli.main(["lab", "--synthetic", "20", flag, str(missing)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (f"asyncinfer: error: {flag} {missing}: No such file or directory (the directory "
                                f"{missing.parent} does not exist)\n")


def test_lab_names_the_file_a_plot_without_a_suffix_is_written_to(tmp_path, capsys) -> None:
    """matplotlib writes ``--plot figures`` as figures.png: the lab said ``plot saved to figures``, a file that
    is not there."""
    assert cli.main(["lab", "--synthetic", "20", "--plot", str(tmp_path / "figures")]) == 0
    assert capsys.readouterr().out.endswith(f"plot saved to {tmp_path / 'figures.png'}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["figures.png"]


@pytest.mark.parametrize(("argv", "error"), [
    (["bench", "--num-requests", "0"], "--num-requests 0 is invalid: allowed an integer >= 1"),
    (["generate", "--prompt", "hi", "--concurrency", "0"], "--concurrency 0 is invalid: allowed an integer >= 1"),
    (["bench", "--concurrency", "1,,4"],  # the empty entry was dropped unsaid: levels 1 and 4 ran
     "--concurrency '1,,4' is invalid: allowed comma-separated integers in [1, 100000], e.g. 1,4,16"),
])
def test_a_commands_own_flag_checks_read_as_every_other_refusal(argv, error, capsys) -> None:
    """``bench --num-requests 0`` said ``--num-requests=0 is invalid: allowed an int >= 1``, where every other
    refusal reads ``--max-tokens 0 is invalid: allowed an integer >= 1``."""
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"asyncinfer: error: {error}\n"


def test_lab_calibrate_into_a_missing_directory_is_refused_before_calibrating(tmp_path, capsys, monkeypatch) -> None:
    """``lab --calibrate /nonexist/cm.json`` calibrated for seconds, then failed with ``No such file or directory``
    naming no flag."""
    from asyncinfer.commands import calibrate

    def no_run(*args, **kwargs):
        raise AssertionError("the calibration ran")

    monkeypatch.setattr(calibrate, "calibrate", no_run)
    path = tmp_path / "gone" / "cm.json"
    assert cli.main(["lab", "--calibrate", str(path)]) == 2
    assert capsys.readouterr().err == (f"asyncinfer: error: --calibrate {path}: No such file or directory (the "
                                       f"directory {path.parent} does not exist)\n")
