"""stranger30: a stranger's first hour with the pages nobody had followed (memory, scale-out, guides, the
less common subcommands and calls)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncinfer import InvalidParameterError, cli, lab


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def test_lab_synthetic_trace_stays_within_max_model_len(tmp_path: Path, capsys) -> None:
    """``asyncinfer lab --max-model-len 1024`` (no --trace) drew its long prompts from 512-2048 tokens whatever the
    limit and was refused as ``--trace 'r15' is invalid: allowed prompts shorter than max_model_len=1024``: a flag
    never given, and no way to run the synthetic trace below 2049 tokens but --long-fraction 0."""
    saved = tmp_path / "t.jsonl"
    assert cli.main(["lab", "--synthetic", "50", "--schedulers", "fifo", "--max-model-len", "1024",
                     "--save-trace", str(saved)]) == 0
    prompts = [json.loads(line)["prompt_len"] for line in saved.read_text().splitlines()]
    assert len(prompts) == 50 and 512 <= max(prompts) <= 1023  # the long prompts drawn below the limit
    assert "trace: synthetic: 50 requests" in capsys.readouterr().out
    assert cli.main(["lab", "--synthetic", "5", "--schedulers", "fifo", "--max-model-len", "2"]) == 0
    capsys.readouterr()
    assert cli.main(["lab", "--synthetic", "5", "--schedulers", "fifo", "--max-model-len", "1"]) == 2
    assert _error_line(capsys) == ("asyncinfer: error: --max-model-len 1 is invalid: allowed an integer >= 2 (a "
                                   "synthetic request's prompt and output)")
    # the default limit leaves the default trace as it was
    assert lab.synthetic_trace(200, seed=0) == lab.synthetic_trace(200, seed=0, max_prompt_len=4095)
    with pytest.raises(InvalidParameterError, match="max_prompt_len"):
        lab.synthetic_trace(3, max_prompt_len=0)


def test_bench_profile_steps_without_profile_is_refused(capsys) -> None:
    """``asyncinfer bench --profile-steps 5`` ran the whole benchmark and profiled nothing, saying nothing: the
    flag is read only with --profile DIR (as lab's --model only with --calibrate)."""
    assert cli.main(["bench", "--threads", "1", "--profile-steps", "5"]) == 2
    assert _error_line(capsys) == ("asyncinfer: error: --profile-steps is used only with --profile DIR (where the "
                                   "profile is written)")


def test_info_names_the_flags_a_sentence_encoder_takes(minilm_dir: Path, capsys) -> None:
    """``asyncinfer info --model all-MiniLM-L6-v2 --max-model-len 100`` answered with the library's option names,
    ``allowed an embedding-model option: ['device', ..., 'max_seq_len', ...]; did you mean max_seq_len?``: no
    command has a --max-seq-len flag, so the advice could not be followed."""
    assert cli.main(["info", "--threads", "1", "--model", str(minilm_dir), "--max-model-len", "100"]) == 2
    assert _error_line(capsys) == (
        "asyncinfer: error: --max-model-len 100 is invalid: allowed a flag a sentence encoder takes (--dtype, "
        "--device, --threads); --max-model-len is a text generator's")
