"""A twelfth stranger's first hour with the command line: what misled, each held to its fix."""

from __future__ import annotations

import argparse

import pytest

from asyncinfer import cli
from asyncinfer.commands import foreign_flags
from tests.helpers import cli_commands


# ------------------------------------------------------------------------- the aliases, on every command
def test_every_command_that_has_a_flag_takes_its_aliases() -> None:
    """The README: "``-m`` = ``--model``, ``-t`` = ``--threads``, ``-c`` / ``--ctx-size`` = ``--max-model-len``".
    ``asyncinfer plan -m x`` was "unrecognized arguments: -m" (``info -m x`` worked), ``embed -t 1`` was refused
    (``chat -t 1`` worked), and ``lab``'s ``--model``, ``--threads`` and ``--max-model-len`` had none."""
    missing = []
    for name, parser in cli_commands().items():
        flags = {f: a for a in parser._actions for f in a.option_strings}
        for flag, aliases in foreign_flags.ALIASES.items():
            if flag in flags:
                missing += [f"{name} {alias}" for alias in aliases if flags.get(alias) is not flags[flag]]
    assert missing == []


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["plan", "-m", "x.gguf"], "model", "x.gguf"),
    (["embed", "-t", "1", "a text"], "threads", 1),
    (["lab", "-c", "2048"], "max_model_len", 2048),
    (["lab", "--calibrate", "out.json", "-m", "x.gguf", "-t", "2"], "threads", 2),
])
def test_the_aliases_set_the_flags_value(argv, field, value) -> None:
    assert getattr(cli._parse(cli.build_parser(), argv), field) == value


@pytest.mark.parametrize("flag", ["--max-model-len", "--ctx-size", "-c"])
def test_plan_takes_the_engines_max_model_len_flag_for_its_seq_len(flag) -> None:
    """``asyncinfer plan --max-model-len 1024`` (the flag ``info``, ``serve`` and the plan's own "the same as
    flags" line use for it) was refused as "unrecognized arguments: --max-model-len; did you mean --model?"."""
    assert cli._parse(cli.build_parser(), ["plan", flag, "1024"]).seq_len == 1024


def test_a_bad_plan_length_names_the_flag(capsys, tiny_models) -> None:
    """The planner's own check, reached through the alias: the message names the flag as typed (stranger60:
    ``--max-model-len`` refused as ``--seq-len``, a flag the user never typed)."""
    assert cli.main(["plan", str(tiny_models["llama"][0]), "-c", "513"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: -c 513 is invalid: allowed an integer >= 2 and <= 512\n"


# ------------------------------------------------------------------------- the Ray Serve example's flags
def _ray_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "ray_serve.py"
    spec = importlib.util.spec_from_file_location("ray_serve_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_flag_of_the_ray_example_says_what_it_does_and_its_default() -> None:
    """``python examples/ray_serve.py --help`` listed ``--replicas``, ``--autoscale``, ``--cpus-per-replica``,
    ``--max-model-len``, ``--host``, ``--port`` and ``--max-tokens`` with no word of what they do or their default."""
    parser = _ray_example().parser()
    bare = [a.option_strings[0] for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction) and "(default: " not in (a.help or "")]
    assert bare == []


@pytest.mark.parametrize(("argv", "message"), [
    (["--autoscale", "4"], ("argument --autoscale: '4' is not MIN:MAX, two replica counts with 0 <= MIN <= MAX and "
                           "MAX >= 1 (e.g. 1:4)")),
    (["--autoscale", "4:1"], ("argument --autoscale: '4:1' is not MIN:MAX, two replica counts with 0 <= MIN <= MAX "
                             "and MAX >= 1 (e.g. 1:4)")),
    (["--replicas", "0"], "argument --replicas: '0' is not above 0"),
    (["--cpus-per-replica", "x"], "argument --cpus-per-replica: 'x' is not a number"),
])
def test_the_ray_examples_bad_flags_are_refused_before_ray_starts(capsys, argv, message) -> None:
    """``--autoscale 4`` started Ray and Serve, then died with a ValueError traceback ("not enough values to
    unpack"). The counts are held above 0 the same way."""
    with pytest.raises(SystemExit) as exited:
        _ray_example().parser().parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].split(": error: ", 1)[1] == message


def test_the_ray_examples_autoscale_bounds_are_read() -> None:
    assert _ray_example().parser().parse_args(["--autoscale", "1:4"]).autoscale == (1, 4)


def test_every_flag_of_the_openai_server_example_says_its_default() -> None:
    """``python examples/openai_server.py --help`` listed ``--host`` and ``--port`` with no word at all."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(root / "examples" / "openai_server.py"), "--help"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    flags = out.split("options:", 1)[1].replace("\n                       ", " ").split("\n  -")[1:]
    assert [f.split()[0] for f in flags if "(default: " not in f] == ["h,"]  # --help alone
    assert "address to listen on (default: 127.0.0.1, this machine only)" in " ".join(out.split())


# ------------------------------------------------------------------------- bench's lengths
@pytest.mark.parametrize(("flags", "message"), [
    (["--input-len", "600", "--output-len", "2"],
     ("--input-len 600 + --output-len 2 = 602 tokens per request, more than --max-model-len 512 (prompt + output, the "
     "model's context): lower --input-len or --output-len")),
    (["--input-len", "30", "--output-len", "3", "-c", "32"],
     ("--input-len 30 + --output-len 3 = 33 tokens per request, more than --max-model-len 32 (prompt + output): lower "
     "--input-len or --output-len (or raise --max-model-len, up to the model's context, 512)")),
])
def test_bench_lengths_past_max_model_len_are_refused_in_its_flags(tiny_models, capsys, flags, message) -> None:
    """``asyncinfer bench --input-len 9000`` said "prompt='<9000 tokens>' is invalid: allowed at most max_model_len
    - 1 = 8191 tokens", and ``--output-len`` past the rest a ``max_tokens`` error: neither is a flag of bench."""
    argv = ["bench", str(tiny_models["llama"][0]), "--num-requests", "1", "--concurrency", "1", *flags]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"asyncinfer: error: {message}\n"


def test_bench_lengths_that_fill_max_model_len_exactly_run(tiny_models, capsys) -> None:
    argv = ["bench", str(tiny_models["llama"][0]), "--num-requests", "1", "--concurrency", "1", "--input-len", "29",
            "--output-len", "3", "-c", "32"]
    assert cli.main(argv) == 0
    assert "asyncinfer       1     1" in capsys.readouterr().out


# ------------------------------------------------------------------------- generate's refusals
def test_generates_refusal_of_max_tokens_names_a_fix_a_job_can_use(tiny_models, tmp_path, capsys) -> None:
    """A job line whose ``max_tokens`` passed the context got "... or SamplingParams(truncate_output_to_model_len=True)
    to stop at --max-model-len", a Python call; a job says it in its line, where the key works."""
    import json

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": [5, 6], "max_tokens": 40}\n'
                       '{"prompt": [5, 6], "max_tokens": 40, "truncate_output_to_model_len": true}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(tiny_models["llama"][0]), "--file", str(prompts), "--output", str(out), "-c", "20"]
    assert cli.main(argv) == 1
    refused, served = (json.loads(line) for line in out.read_text(encoding="utf-8").splitlines())
    assert refused["error"] == (
        "max_tokens=40 is invalid: allowed at most --max-model-len - prompt tokens = 20 - 2 = 18 (or shorten the "
        "prompt, or a --file line's \"truncate_output_to_model_len\": true to stop at --max-model-len)")
    assert (served["finish_reason"], served["completion_tokens"]) == ("length", 18)


# ------------------------------------------------------------------------- reST in --help
def test_no_help_shows_rest_literal_markers() -> None:
    """``asyncinfer generate --help`` printed its docstring's "Input, one request a line (--file; - reads
    stdin)::" and "Output: ... (--output, default stdout)::", reST's literal-block markers."""
    texts = [cli.build_parser().format_help(), *(p.format_help() for p in cli_commands().values())]
    assert [line for text in texts for line in text.splitlines() if line.rstrip().endswith("::")] == []
    generate = cli_commands()["generate"].format_help()
    assert "Input, one request a line (--file; - reads stdin):\n" in generate
    assert cli.plain_text("a ``b`` c::\n\n    x :: y\n") == "a b c:\n\n    x :: y\n"


# ------------------------------------------------------------------------- plan's none
def test_plans_quantization_refusal_spells_none_as_the_flag_takes_it(tiny_models, capsys) -> None:
    """``asyncinfer plan --quantization int4`` listed "allowed 'auto', None, 'float16', ...": the flag takes
    ``none`` (``info --quantization int4`` already said so)."""
    assert cli.main(["plan", str(tiny_models["llama"][0]), "--quantization", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncinfer: error: --quantization 'bfloat16' is invalid: allowed 'auto', none, 'float16', ")
    assert "None" not in err
