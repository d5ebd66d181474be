"""``asyncinfer generate -c 64 --max-tokens 70 --prompt hi`` loaded the model to refuse the prompt as the job's one
error line, whose fix named a --file line's "truncate_output_to_model_len" that a --prompt job cannot set; chat
refuses the same flags before loading. Now refused before the load in the flags' terms, and a --prompt job's
per-prompt refusal (a prompt too long for its --max-tokens) names the flags it has."""

from __future__ import annotations

import json

import pytest

from asyncinfer import cli


@pytest.mark.parametrize("max_tokens", ["64", "70"])
def test_max_tokens_no_prompt_leaves_room_for_is_refused_before_the_load(no_load, capsys, max_tokens) -> None:
    assert cli.main(["generate", "-c", "64", "--max-tokens", max_tokens, "--prompt", "hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"asyncinfer: error: --max-tokens {max_tokens} is invalid: allowed less than --max-model-len "
                            "(64), a prompt takes one token at least; lower --max-tokens or raise --max-model-len\n")


@pytest.mark.real_model
def test_a_prompt_job_s_refusal_names_its_flags_a_file_line_its_keys(real_gguf, tmp_path) -> None:
    long = "hello " * 30  # 31 tokens: 64 - 31 = 33 left, under --max-tokens 60
    out = tmp_path / "out.jsonl"
    common = ["generate", str(real_gguf), "-c", "64", "--max-tokens", "60", "--no-progress", "-o", str(out)]
    assert cli.main([*common, "--prompt", long]) == 1
    error = json.loads(out.read_text())["error"]
    assert error == ("max_tokens=60 is invalid: allowed at most --max-model-len - prompt tokens = 64 - 31 = 33 "
                     "(or shorten the prompt, or lower --max-tokens, or raise --max-model-len)")
    lines = tmp_path / "jobs.jsonl"
    lines.write_text(json.dumps({"prompt": long}) + "\n")
    assert cli.main([*common, "--file", str(lines)]) == 1
    error = json.loads(out.read_text())["error"]
    assert error.endswith('(or shorten the prompt, or a --file line\'s "truncate_output_to_model_len": true to stop at '
                          "--max-model-len)")


@pytest.mark.real_model
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_without_max_model_len_the_models_context_refuses_it_before_any_prompt_runs(real_gguf, tmp_path, capsys,
                                                                                    command) -> None:
    """stranger64: with no --max-model-len, ``generate --prompt x --max-tokens 8192`` loaded, ran the prompt and wrote
    it as the job's one error line (exit 1), where ``chat`` refused the same flags (exit 2); and both said "raise
    --max-model-len", already the model's whole context. Both now refuse it once the model's context is known,
    before any prompt runs, saying what bounds it."""
    out = tmp_path / "out.jsonl"
    argv = (["generate", str(real_gguf), "--prompt", "x", "-o", str(out), "--no-progress"] if command == "generate"
            else ["chat", "--model", str(real_gguf), "x"])
    assert cli.main([*argv, "--max-tokens", "8192", "--threads", "1"]) == 2
    captured = capsys.readouterr()
    assert not out.exists() or out.read_text() == ""
    said = ("--max-tokens 8192 is invalid: allowed less than the model's context (8192 tokens, the default "
            "--max-model-len)")
    assert captured.err.startswith(f"asyncinfer: error: {said}") and "raise --max-model-len" not in captured.err
    assert captured.err.count("\n") == 1


@pytest.mark.real_model
def test_without_max_model_len_a_prompt_jobs_refusal_says_none_is_left_to_raise(real_gguf, tmp_path) -> None:
    """With no --max-model-len the model's whole context is in use: a prompt too long for its --max-tokens was told
    to "raise --max-model-len" all the same."""
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(real_gguf), "--max-tokens", "100", "--no-progress", "-o", str(out), "--threads", "1",
            "--prompt", "hello " * 8150]
    assert cli.main(argv) == 1
    error = json.loads(out.read_text())["error"]
    assert error.startswith("max_tokens=100 is invalid: allowed at most --max-model-len - prompt tokens = 8192 - ")
    assert error.endswith("(or shorten the prompt, or lower --max-tokens (--max-model-len is the model's whole "
                          "context already))")
