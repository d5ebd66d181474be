"""A newcomer's first hour with the command line (stranger 17): each finding held to its fix."""

from __future__ import annotations

import json

import pytest

from asyncinfer import cli, lab
from asyncinfer.errors import InvalidParameterError


def _lab(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(["lab", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_an_empty_trace_is_refused_by_its_flag(tmp_path, capsys) -> None:
    """``asyncinfer lab --trace empty.jsonl`` replayed nothing and then failed in its report with
    ``internal error: ValueError: min() arg is an empty sequence``."""
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n\n", encoding="utf-8")
    status, out, err = _lab(["--trace", str(trace), "--schedulers", "fifo"], capsys)
    assert (status, out) == (2, "")
    assert err == (f"asyncinfer: error: --trace {str(trace)!r} is invalid: allowed at least one request line "
                   "(the file has none)\n")


def test_the_library_refuses_an_empty_trace_and_empty_records() -> None:
    with pytest.raises(InvalidParameterError) as caught:
        lab.simulate([], "fifo")
    assert (caught.value.parameter, caught.value.allowed) == ("trace", "at least one request")
    with pytest.raises(InvalidParameterError) as caught:
        lab.summarize("fifo", [])
    assert caught.value.parameter == "records"


def test_a_trace_line_that_is_a_list_says_so(tmp_path, capsys) -> None:
    """A line holding a JSON list was explained with Python's ``'list' object has no attribute 'get'``."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('[{"arrival": 0, "prompt_len": 10, "output_len": 4}]\n', encoding="utf-8")
    status, _, err = _lab(["--trace", str(trace), "--schedulers", "fifo"], capsys)
    assert status == 2
    assert err == (f"asyncinfer: error: --trace {trace} line 1: expected a JSON object with arrival, prompt_len, "
                   "output_len[, priority, id] (a JSON list, not an object)\n")


def test_an_infinite_rate_is_refused(capsys) -> None:
    """``--rate inf`` drew every arrival at time 0 and reported it as a Poisson trace at inf/s."""
    status, _, err = _lab(["--synthetic", "3", "--schedulers", "fifo", "--rate", "inf"], capsys)
    assert status == 2
    assert err == "asyncinfer: error: --rate inf is invalid: allowed a finite number of requests per second > 0\n"


@pytest.mark.parametrize(("argv", "flags"), [(["--model", "foo"], "--model is"),
                                             (["-t", "2", "-m", "x"], "--model and --threads are")])
def test_calibration_flags_without_calibrate_are_refused(capsys, argv: list[str], flags: str) -> None:
    """``asyncinfer lab --model M`` (or ``--threads``) ran the shipped cost model and ignored the flag: the
    figures looked like M's."""
    status, out, err = _lab(["--synthetic", "3", "--schedulers", "fifo", *argv], capsys)
    assert (status, out) == (2, "")
    assert err == (f"asyncinfer: error: {flags} used only with --calibrate (the lab replays the trace on a cost "
                   "model and loads no model; --cost-model FILE picks one made by asyncinfer lab --calibrate FILE "
                   "--model MODEL)\n")


@pytest.mark.parametrize(("option", "allowed"), [
    ("pd-split.prefill_budget=0", "an integer >= 1"),
    ('pd-split.prefill_budget="a"', "an integer >= 1"),
    ("pd-split.bogus=1", ("keywords PDSplitScheduler accepts: prefill_budget (got an unexpected keyword argument "
                          "'bogus')")),
])
def test_a_refused_option_is_named_as_typed(capsys, option: str, allowed: str) -> None:
    """A scheduler's refusal of ``--option pd-split.prefill_budget=0`` read ``prefill_budget=0 is invalid``
    (``scheduler_options={'bogus': 1}`` for an unknown key), naming neither the flag nor the policy, where
    ``serve`` names ``--scheduler-option``."""
    status, out, err = _lab(["--synthetic", "3", "--schedulers", "fifo,pd-split", "--option", option], capsys)
    assert (status, out) == (2, "")
    assert err == f"asyncinfer: error: --option {option} is invalid: allowed {allowed}\n"


def test_the_lab_still_runs_with_good_flags(tmp_path, capsys) -> None:
    figures = tmp_path / "f.json"
    status, out, err = _lab(["--synthetic", "3", "--schedulers", "fifo,pd-split", "--option",
                             "pd-split.prefill_budget=64", "--slo-ttft", "1.5", "--json", str(figures)], capsys)
    assert (status, err) == (0, "")
    assert "SLO: TTFT <= 1.5s and TPOT <= 0.5s" in out
    assert [s["policy"] for s in json.loads(figures.read_text())["summaries"]] == ["fifo", "pd-split"]


@pytest.mark.parametrize(("argv", "error"), [
    (["--max-num-seqs", "0"], "--max-num-seqs 0 is invalid: allowed an integer >= 1 and <= 4096"),
    (["--max-num-seqs", "5000"], "--max-num-seqs 5000 is invalid: allowed an integer >= 1 and <= 4096"),
    (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens -1 is invalid: allowed an integer >= 1"),
])
def test_plan_refuses_step_limits_the_engine_refuses(tiny_models, capsys, argv: list[str], error: str) -> None:
    """``asyncinfer plan --max-num-seqs 0`` printed a plan, and as the flags that load it ``--max-num-seqs 0``,
    which every engine command refuses (``--max-num-batched-tokens -1`` the same)."""
    status = cli.main(["plan", str(tiny_models["llama"][0]), "--device-memory", "1GiB", *argv])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == f"asyncinfer: error: {error}\n"


def test_plan_deployment_checks_the_step_limits(tiny_models) -> None:
    from asyncinfer.memory import read_model_config
    from asyncinfer.planner import plan_deployment

    config = read_model_config(tiny_models["llama"][0])
    with pytest.raises(InvalidParameterError) as caught:
        plan_deployment(config, max_num_seqs=True, device_memory=2**30)
    assert caught.value.parameter == "max_num_seqs"
    with pytest.raises(InvalidParameterError) as caught:
        plan_deployment(config, max_num_batched_tokens=0, device_memory=2**30)
    assert caught.value.parameter == "max_num_batched_tokens"
    plan = plan_deployment(config, max_num_seqs=4096, max_num_batched_tokens=1, device_memory=2**30)
    assert plan.engine_options()["max_num_seqs"] == 4096


@pytest.mark.parametrize(("flag", "name", "error"), [
    ("--json", "missing/figures.json", "--json {path}: No such file or directory (the directory {parent} does not exist)"),
    ("--plot", "missing/figures.png", "--plot {path}: No such file or directory (the directory {parent} does not exist)"),
    ("--plot", ".", "--plot {path}: Is a directory"),
    ("--profile", "afile", ("--profile {path}: not a directory (a file is there; the profile writes DIR/trace.json "
                            "and DIR/top_ops.txt)")),
])
def test_bench_refuses_an_unwritable_output_before_it_runs(tmp_path, capsys, monkeypatch, flag: str, name: str,
                                                           error: str) -> None:
    """``asyncinfer bench --json missing/figures.json`` ran every concurrency level (minutes) and then failed with
    ``No such file or directory``; ``--profile FILE`` failed after the table as ``path='FILE' is invalid``."""
    from asyncinfer.commands import bench

    def no_run(*args, **kwargs):  # the benchmark must not start
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench, "_bench_engine", no_run)
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    path = str(tmp_path / name)
    status = cli.main(["bench", "--num-requests", "1", "--concurrency", "1", flag, path])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    expected = error.format(path=path, parent=tmp_path / "missing")
    assert captured.err == f"asyncinfer: error: {expected}\n"
