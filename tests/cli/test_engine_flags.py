"""Every engine option is a flag of the commands that load a model, from one table (commands/engine_flags.py):
the table against EngineConfig's fields, each flag's help and default, the README's options table against
the table, errors in the flags' terms, and --help as plain text."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from asyncinfer import cli
from asyncinfer.commands.engine_flags import BY_FIELD, FLAGS, shown_default
from asyncinfer.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]
MODEL_COMMANDS = ["chat", "generate", "bench", "info", "serve"]

# A value for every option, as typed and as the engine gets it (none of them the default).
EVERY_FLAG: dict[str, tuple[list[str], object]] = {
    "dtype": (["--dtype", "float32"], "float32"),
    "device": (["--device", "cpu"], "cpu"),
    "block_size": (["--block-size", "32"], 32),
    "kv_cache_memory": (["--kv-cache-memory", "4MiB"], 4 * 1024 * 1024),
    "kv_cache_fraction": (["--kv-cache-fraction", "0.1"], 0.1),
    "max_num_seqs": (["--max-num-seqs", "8"], 8),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "256"], 256),
    "max_model_len": (["--max-model-len", "512"], 512),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"], False),
    "scheduler": (["--scheduler", "pd-split"], "pd-split"),
    "scheduler_options": (["--scheduler-option", "prefill_budget=64"], {"prefill_budget": 64}),
    "seed": (["--engine-seed", "7"], 7),
    "num_threads": (["--threads", "2"], 2),
    "activation_reserve": (["--activation-reserve", "128MiB"], 128 * 1024 * 1024),
    "quantization": (["--quantization", "none"], None),
    "quantization_skip": (["--quantization-skip", "down_proj,lm_head"], ("down_proj", "lm_head")),
    "pack_weights": (["--no-pack-weights"], False),
    "activation_dtype": (["--activation-dtype", "int8"], "int8"),
    "torch_compile": (["--torch-compile"], True),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "kv_watermark": (["--kv-watermark", "0.05"], 0.05),
    "max_waiting_requests": (["--max-waiting-requests", "3"], 3),
    "max_consecutive_step_failures": (["--max-consecutive-step-failures", "5"], 5),
    "stall_timeout": (["--stall-timeout", "none"], None),
    "enable_metrics": (["--no-enable-metrics"], False),
    "memory_bandwidth": (["--memory-bandwidth", "2e10"], 2e10),
    "log_request_text_rate": (["--log-request-text-rate", "0.5"], 0.5),
}


def test_the_table_has_every_engine_option_once() -> None:
    assert [f.field for f in FLAGS] == FIELDS  # the dataclass's order, none missing, none extra
    assert len({f.flag for f in FLAGS}) == len(FLAGS)
    assert set(EVERY_FLAG) == set(FIELDS)


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_option_is_a_flag_with_help_and_default(command) -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    by_dest = {a.dest: a for a in sub._actions}
    for flag in FLAGS:
        action = by_dest[flag.dest]
        assert flag.flag in action.option_strings
        assert action.help and action.help.endswith(f"(default: {shown_default(flag, EngineConfig.__dataclass_fields__[flag.field].default)})"), action.help
    argv = [command, *(["--prompt", "x"] if command == "generate" else [])]
    argv += [word for words, _ in EVERY_FLAG.values() for word in words]
    options = cli._engine_options(parser.parse_args(argv))
    assert options == {field: value for field, (_, value) in EVERY_FLAG.items()}
    config = EngineConfig.from_options({k: v for k, v in options.items() if k != "torch_compile"})
    assert config.max_waiting_requests == 3 and config.enable_prefix_caching is False


def test_every_serve_flag_has_help_and_a_default() -> None:
    parser = cli.build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    for action in serve._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and "default:" in action.help, (action.option_strings or action.dest, action.help)


def test_a_flag_not_given_keeps_the_library_default_and_none_is_none() -> None:
    parser = cli.build_parser()
    assert cli._engine_options(parser.parse_args(["serve"])) == {}
    args = parser.parse_args(["serve", "--max-model-len", "none", "--kv-cache-memory", "none", "--threads", "None"])
    assert cli._engine_options(args) == {"max_model_len": None, "kv_cache_memory": None, "num_threads": None}


def readme_options() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def readme_default(value: object) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def test_the_readme_options_table_lists_every_option_with_its_flag_and_default() -> None:
    rows = readme_options()
    assert [row[0] for row in rows] == [f"`{name}`" for name in FIELDS]
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for option, flag, default, *_ in rows:
        name = option.strip("`")
        assert flag == f"`{BY_FIELD[name].flag}`", name
        assert default == readme_default(defaults[name]), name


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_errors_name_the_flag_and_spell_none_as_the_flag_takes_it(tiny_models, capsys) -> None:
    path = str(tiny_models["llama"][0])
    assert cli.main(["info", path, "--kv-cache-fraction", "2"]) == 2
    assert one_line_error(capsys) == ("asyncinfer: error: --kv-cache-fraction 2 is invalid: allowed a number in "
                                      "(0, 0.95], or none (from the workload)\n")
    assert cli.main(["info", path, "--stall-timeout", "-1"]) == 2
    assert one_line_error(capsys) == ("asyncinfer: error: --stall-timeout -1 is invalid: allowed a finite number "
                                      "of seconds > 0, or none\n")
    assert cli.main(["info", path, "--quantization", "bogus"]) == 2
    err = one_line_error(capsys)
    assert err.startswith("asyncinfer: error: --quantization 'bogus' is invalid: allowed ") and "none" in err
    assert not re.search(r"\bNone\b", err), err
    assert cli.main(["info", path, "--max-model-len", "1"]) == 2
    assert one_line_error(capsys) == "asyncinfer: error: --max-model-len 1 is invalid: allowed an integer >= 2\n"


@pytest.mark.parametrize("command", [[], *[[c] for c in ("chat", "generate", "bench", "info", "plan", "embed",
                                                          "lab", "serve")]])
def test_help_is_plain_text(command, capsys) -> None:
    """No reST markup from the docstrings on a terminal: no double backticks, no :role:`...`."""
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and not re.search(r":[a-z]+:`", out), out
    assert "None" not in out.replace("--help", ""), [line for line in out.splitlines() if "None" in line]


def test_the_auto_weight_format_rule_is_stated_as_the_code_decides_it() -> None:
    """Every format resolve_quantization("auto", ...) can pick here is named where "auto" is explained:
    EngineConfig's docstring, the README's quantization row and --quantization's help (the docstring said
    "float16 on a CPU" after the default had become the GGUF file's own q4_1)."""
    import torch

    from asyncinfer.models.quant import resolve_quantization

    picked = {resolve_quantization("auto", torch.device(device), dtype, native)
              for device in ("cpu", "cuda") for dtype in ("auto", "float32") for native in (None, "q4_1", "q8_0", "native")}
    docstring = EngineConfig.__doc__.split("- ``quantization``:", 1)[1]
    auto = docstring.split('"auto" (default):', 1)[1].split(" None: ", 1)[0]
    readme = next(row for row in readme_options() if row[0] == "`quantization`")[3]
    readme_auto = readme.split("`\"auto\"`, on a CPU", 1)[1].split("CPU, float32 activations", 1)[0]
    flag_auto = BY_FIELD["quantization"].help.split("auto (", 1)[1].split(") |", 1)[0]
    for fmt in picked:
        assert (f'"{fmt}"' if fmt else "None") in auto, (fmt, auto)
        assert (f'`"{fmt}"`' if fmt else "None") in readme_auto, (fmt, readme_auto)
        assert (fmt or "none") in flag_auto, (fmt, flag_auto)
