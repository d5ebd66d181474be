"""A newcomer's first hour with the command line (stranger 17): each finding held to its fix."""

from __future__ import annotations

import json
import math

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
    (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens -1 is invalid: allowed an integer >= 1 and <= 9223372036854775807"),
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


@pytest.mark.real_model
def test_generate_writes_the_logprobs_a_line_asks_for(real_gguf, tmp_path, capsys) -> None:
    """A ``--file`` line with ``"logprobs": 2`` was accepted (a SamplingParams field) and its output line had
    no log-probabilities at all: they are written, per sample, as the engine returns them."""
    import asyncio

    from asyncinfer import AsyncEngine, RequestOutput, SamplingParams

    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "The capital of France is", "logprobs": 2, "max_tokens": 3}\n'
                     '{"prompt": "The capital of France is", "logprobs": 0, "max_tokens": 2, "n": 2, '
                     '"temperature": 1, "seed": 3}\n'
                     '{"prompt": "The capital of France is", "max_tokens": 2}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    options = ["--threads", "1", "-c", "64", "--no-progress"]
    assert cli.main(["generate", str(real_gguf), "--file", str(lines), "--output", str(out), *options]) == 0
    capsys.readouterr()
    first, second, third = (json.loads(line) for line in out.read_text(encoding="utf-8").splitlines())

    async def reference() -> RequestOutput:
        async with await AsyncEngine.load(real_gguf, num_threads=1, max_model_len=64) as engine:
            return await engine.generate("The capital of France is", SamplingParams(max_tokens=3, logprobs=2))

    greedy = asyncio.run(reference())
    # The same tokens and alternatives; the values agree within batching's rounding (the job runs its lines
    # together, the reference one at a time: their prefills take the block kernels' float32 panel where the
    # reference's, under PANEL_MIN_ROWS rows, rounds its activations to int16; the log-probabilities differ by up to
    # ~1e-3 with the CPU's kernel variant, 1.02e-3 seen on an AVX-512 VNNI Xeon).
    assert [lp["token_id"] for lp in first["logprobs"]] == greedy.token_ids
    assert [[t for t, _ in lp["top"]] for lp in first["logprobs"]] == [[t for t, _ in lp.top] for lp in greedy.logprobs]
    assert [lp["logprob"] for lp in first["logprobs"]] == pytest.approx([lp.logprob for lp in greedy.logprobs],
                                                                         abs=5e-3)
    assert len(first["logprobs"]) == 3 and all(len(lp["top"]) == 2 for lp in first["logprobs"])
    assert second["completion_tokens"] == 4 and [len(o["logprobs"]) for o in second["outputs"]] == [2, 2]
    assert second["logprobs"] == second["outputs"][0]["logprobs"]  # the line's own are its first sample's
    assert all(lp["top"] == [] for o in second["outputs"] for lp in o["logprobs"])
    assert "logprobs" not in third


def test_generate_logprobs_are_strict_json() -> None:
    from asyncinfer.commands.generate import _logprobs
    from asyncinfer.outputs import Logprob

    assert _logprobs([Logprob(5, -0.5, [(5, -0.5), (7, -math.inf)])]) == [
        {"token_id": 5, "logprob": -0.5, "top": [[5, -0.5], [7, None]]}]
    assert _logprobs(None) == []


def test_generate_skips_a_byte_order_mark(tmp_path) -> None:
    """A --file saved by a Windows editor (UTF-8 with a byte-order mark) failed on its first line with
    ``not JSON (Unexpected UTF-8 BOM (decode using utf-8-sig): ...)``, advice a user of the command cannot take."""
    import argparse

    from asyncinfer import SamplingParams
    from asyncinfer.commands.generate import _jobs

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "id": "x"}\n{"prompt": "\xef\xbb\xbfb"}\n')
    args = argparse.Namespace(prompt=None, file=str(path), chat=False)
    jobs = list(_jobs(args, SamplingParams(max_tokens=2)))
    assert [(job.id, job.prompt) for job in jobs] == [("x", "a"), (1, "\ufeffb")]  # inside a string: kept
