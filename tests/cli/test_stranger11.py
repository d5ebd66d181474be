"""An eleventh stranger's first hour: `plan` flags that did not load its plan; an activation dtype's case."""

from __future__ import annotations

import shlex

import pytest

from asyncinfer import EngineConfig, InvalidParameterError
from asyncinfer.cli import _engine_options, build_parser, main


def _plan_lines(capsys, path: str, *extra: str) -> list[str]:
    assert main(["plan", path, "--batch", "6", "--seq-len", "100", "--device-memory", "1GiB", *extra]) == 0
    return capsys.readouterr().out.splitlines()


def _flag_options(path: str, lines: list[str]) -> dict[str, object]:
    (line,) = [x for x in lines if x.startswith("the same as flags: ")]
    return _engine_options(build_parser().parse_args(["serve", path, *shlex.split(line.removeprefix(
        "the same as flags: "))]))


def test_plan_flags_carry_the_step_it_was_planned_for(tiny_models, capsys) -> None:
    """`plan --max-num-seqs 6 --max-num-batched-tokens 512` sized the activations for that step, but its printed
    flags left both out: the engine they started ran 128 sequences and 1024 tokens a step."""
    path = str(tiny_models["llama"][0])
    lines = _plan_lines(capsys, path, "--max-num-seqs", "6", "--max-num-batched-tokens", "512")
    options = _flag_options(path, lines)
    assert (options["max_num_seqs"], options["max_num_batched_tokens"]) == (6, 512)
    assert not any(x.startswith("note: ") for x in lines)
    # at the engine's defaults the flags stay as they were (the docs' sample)
    default = _flag_options(path, _plan_lines(capsys, path))
    assert "max_num_seqs" not in default and "max_num_batched_tokens" not in default


def test_plan_says_when_its_batch_exceeds_max_num_seqs(tiny_models, capsys) -> None:
    """`plan --batch 200` planned 200 requests at once; the engine its flags start runs 128 a step, silently."""
    path = str(tiny_models["llama"][0])
    lines = _plan_lines(capsys, path, "--max-num-seqs", "4")
    assert lines[-1] == ("note: at most max_num_seqs=4 requests run in one step, the other 2 wait; plan with "
                         "--max-num-seqs 6 to run all 6 at once")


@pytest.mark.parametrize(("given", "read"), [("INT8", "int8"), (" Int16 ", "int16"), ("int8", "int8")])
def test_activation_dtype_in_any_case(given: str, read: str) -> None:
    """`--quantization Q8_0` and `--dtype FLOAT32` were taken, `--activation-dtype INT8` refused."""
    assert EngineConfig(device="cpu", activation_dtype=given).activation_dtype == read


@pytest.mark.parametrize("given", ["int4", "", None, 8])
def test_activation_dtype_still_refused(given: object) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        EngineConfig(device="cpu", activation_dtype=given)
    assert refused.value.parameter == "activation_dtype"


def test_generate_refuses_an_output_that_is_its_input(tiny_models, tmp_path, capsys) -> None:
    """`generate --file p.jsonl --output p.jsonl` ran and replaced the prompts with the results."""
    prompts = tmp_path / "p.jsonl"
    text = '{"prompt": [1, 2, 3]}\n'
    prompts.write_text(text, encoding="utf-8")
    link = tmp_path / "link.jsonl"
    link.symlink_to(prompts)
    model = str(tiny_models["llama"][0])
    for output in (str(prompts), str(link), f"{tmp_path}/./p.jsonl"):
        assert main(["generate", model, "--file", str(prompts), "--output", output, "--max-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err == (f"asyncinfer: error: --output {output} is the --file it reads ({prompts}): writing the "
                       "results there would replace the prompts; choose another --output\n")
        assert prompts.read_text(encoding="utf-8") == text
    # another file is written as before
    out = tmp_path / "out.jsonl"
    assert main(["generate", model, "--file", str(prompts), "--output", str(out), "--max-tokens", "2"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 1


def test_plans_largest_batch_says_when_memory_allows_more_than_a_step_runs(tiny_models, capsys) -> None:
    """`plan` printed "largest batch at N tokens: 547" from memory alone, above the 128 requests a step runs."""
    path = str(tiny_models["llama"][0])
    (line,) = [x for x in _plan_lines(capsys, path, "--max-num-seqs", "4") if x.startswith("largest batch at ")]
    batch = int(line.split(": ")[1].split()[0])
    assert batch > 4 and line.endswith("(memory alone; one step runs at most max_num_seqs=4)")
    # the engine's most max_num_seqs (4096), in memory that holds fewer requests (a later --device-memory wins)
    lines = _plan_lines(capsys, path, "--max-num-seqs", "4096", "--device-memory", "640MiB")
    (line,) = [x for x in lines if x.startswith("largest batch at ")]
    assert line == f"largest batch at 100 tokens: {int(line.split(': ')[1])}"  # within the step: nothing added
