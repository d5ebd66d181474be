"""asyncinfer plan: its KV figure is what the engine allocates, its weights what the engine loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError
from asyncinfer.cli import main
from asyncinfer.memory import GiB, MiB, read_model_config
from asyncinfer.planner import parse_bytes, plan_deployment
from tests.helpers import loaded_bytes


@pytest.mark.parametrize("quantization", [None, "int8", "float16"])
def test_plan_equals_the_engines_allocation_and_weights(tiny_models, quantization) -> None:
    path = tiny_models["llama"][0]
    plan = plan_deployment(read_model_config(path), batch=3, seq_len=100, quantization=quantization,
                           device_memory=1 * GiB, block_size=16)
    assert plan.kv_blocks == 3 * 7  # ceil(100 / 16) blocks per request
    assert plan.engine_options()["quantization"] == quantization and plan.engine_options()["dtype"] == "float32"
    engine = AsyncEngine.from_pretrained(path, device="cpu", memory_bandwidth=1e10, **plan.engine_options())
    assert engine.kv_stats().num_blocks == plan.kv_blocks
    assert engine.memory_plan.kv_bytes == plan.kv_bytes
    assert engine.memory_plan.weight_bytes == plan.weight_bytes == loaded_bytes(engine.core.runner.model)


def test_largest_batch_and_longest_length_are_the_limits(tiny_models) -> None:
    config = read_model_config(tiny_models["llama"][0])
    plan = plan_deployment(config, batch=4, seq_len=256, dtype="float32", device_memory=528 * MiB)
    assert plan.fits
    at_limit = plan_deployment(config, batch=plan.max_batch, seq_len=256, dtype="float32", device_memory=528 * MiB)
    beyond = plan_deployment(config, batch=plan.max_batch + 1, seq_len=256, dtype="float32", device_memory=528 * MiB)
    assert at_limit.fits and not beyond.fits
    tight = plan_deployment(config, batch=1000, seq_len=512, dtype="float32", device_memory=528 * MiB)
    assert not tight.fits and 0 < tight.max_seq_len < 512
    assert plan_deployment(config, batch=1000, seq_len=tight.max_seq_len, dtype="float32", device_memory=528 * MiB).fits
    assert any("max_model_len" in s for s in tight.suggestions)
    assert any(s.startswith("--quantization float16: weights") for s in tight.suggestions)
    (int8,) = [s for s in tight.suggestions if s.startswith("--quantization int8")]
    assert "not enough alone" in int8  # the KV cache, not the weights, is what overflows here


def test_a_format_is_said_to_fit_only_when_it_does(real_gguf) -> None:
    config = read_model_config(real_gguf)
    fp32 = plan_deployment(config, batch=1, seq_len=256, dtype="float32", device_memory=978 * MiB)
    assert not fp32.fits
    (int8,) = [s for s in fp32.suggestions if s.startswith("--quantization int8")]
    assert int8 == "--quantization int8: weights 513.1 MiB -> 285.8 MiB, and the plan fits"
    assert plan_deployment(config, batch=1, seq_len=256, dtype="float32", device_memory=978 * MiB,
                           quantization="int8").fits
    # The defaults (dtype and quantization "auto") plan the engine's own CPU default for this file: its own
    # Q4_1 blocks (ModelConfig.native_format); a config without one gets float16 weights.
    default = plan_deployment(config, batch=1, seq_len=256, device_memory=978 * MiB)
    assert config.native_format == "q4_1"
    assert default.quantization == "q4_1" and default.dtype == torch.float32 and default.fits
    # Q4_1 projections and the Q8_0 head, which is also the embedding (its blocks read for the lookups): no
    # float32 table of 49152 x 576 x 4 bytes beside them
    assert default.suggestions == () and default.weight_bytes == 209_822_976 - 113_246_208 == 96_576_768
    assert default.weight_bytes < fp32.weight_bytes
    plain = plan_deployment(dataclasses.replace(config, native_format=None), batch=1, seq_len=256,
                            device_memory=978 * MiB)
    assert plain.quantization == "float16" and plain.weight_bytes == 382_346_496


def test_cli_prints_the_table_with_the_formula(tiny_models, capsys) -> None:
    path = str(tiny_models["llama"][0])
    assert main(["plan", path, "--batch", "2", "--seq-len", "64", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "2 x 2 layers x 2 kv heads x 16 head dim x 4 bytes x 128 tokens (2 x 64" in out
    for row in ("weights", "KV cache", "activations", "framework overhead", "total", "headroom"):
        assert f"  {row}" in out
    assert "largest batch at 64 tokens:" in out and "kv_cache_memory=" in out
    assert main(["plan", path, "--batch", "100000", "--seq-len", "512", "--device-memory", "500MiB"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", path, "--device", "cuda", "--quantization", "int8", "--device-memory", "8GB"]) == 2


def test_parse_bytes() -> None:
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512MiB") == 512 * MiB and parse_bytes("1.5G") == int(1.5 * GiB) and parse_bytes("1000") == 1000
    with pytest.raises(InvalidParameterError):
        parse_bytes("lots")


def test_a_smaller_format_never_suggests_a_batch_or_length_of_zero(real_gguf) -> None:
    config = read_model_config(real_gguf)
    # int8 weights on a device where even q4_1's weights and the overhead leave no room for one request
    none = plan_deployment(config, quantization="int8", device_memory=300 * MiB)
    formats = [s for s in none.suggestions if s.startswith("--quantization")]
    assert formats and all(s.endswith("not one request fits even with it") for s in formats)
    # room for one shorter request but not for a batch at the full length: only the length is offered
    some = plan_deployment(config, quantization="int8", device_memory=800 * MiB)
    (q8,) = [s for s in some.suggestions if s.startswith("--quantization q8_0")]
    assert "with it, max_model_len " in q8 and "batch 0" not in q8 and "max_model_len 0" not in q8
    for plan in (none, some):
        assert not any(" 0 at " in s or "max_model_len 0" in s for s in plan.suggestions)


@pytest.mark.parametrize("quantization", ["auto", "none", "int8"])
def test_plan_prints_the_flags_that_serve_its_plan(tiny_models, quantization, capsys) -> None:
    """``asyncinfer plan`` ends with the flags of ``asyncinfer serve`` (and the other commands) that load the plan:
    before, it printed Python keyword arguments only, which an operator had to translate to flags."""
    import shlex

    from asyncinfer.cli import _engine_options, build_parser

    path = str(tiny_models["llama"][0])
    assert main(["plan", path, "--batch", "3", "--seq-len", "100", "--device-memory", "1GiB",
                 "--quantization", quantization]) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [x for x in lines if x.startswith("the same as flags: ")]
    flags = shlex.split(line.removeprefix("the same as flags: "))
    options = _engine_options(build_parser().parse_args(["serve", path, *flags]))
    plan = plan_deployment(read_model_config(path), batch=3, seq_len=100, device_memory=1 * GiB,
                           quantization=None if quantization == "none" else quantization)
    assert {k: options[k] for k in plan.engine_options()} == plan.engine_options()
    assert options["device"] == "cpu"


def test_the_rope_tables_count_whatever_the_length(tiny_models, tmp_path) -> None:
    """pass70: a config's max_position_embeddings of 2**31 - 1 makes rope tables of 280 GiB, which every load refuses
    (models.layers.rope_table_bytes); the plan left them out, called a 4096-token deployment a fit with 21 GiB to
    spare and suggested a max_model_len of 30 million."""
    import json
    import shutil

    from asyncinfer import ConfigurationError
    from asyncinfer.models.layers import rope_table_bytes

    path = tmp_path / "huge"
    shutil.copytree(tiny_models["llama"][0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**31 - 1}))
    model_config = read_model_config(path)
    plan = plan_deployment(model_config, seq_len=4096, device_memory=24 * GiB)
    assert plan.rope_bytes == rope_table_bytes(model_config) > 250 * GiB
    assert not plan.fits and plan.max_batch == 0 and plan.max_seq_len == 0
    assert not any(s.startswith(("max_model_len", "batch")) for s in plan.suggestions)
    assert plan.suggestions[-1] == ("a model with a shorter context: its rope tables alone need 280.00 GiB, a row "
                                    "for each of its 2147483647 positions (max_position_embeddings), whatever "
                                    "max_model_len")
    with pytest.raises(ConfigurationError, match="its rope tables"):
        AsyncEngine.plan_memory(path, max_model_len=4096, available_bytes=24 * GiB)
    small = plan_deployment(read_model_config(tiny_models["llama"][0]), device_memory=24 * GiB)
    assert small.rope_bytes == rope_table_bytes(small.model_config) and small.total_bytes == (
        small.weight_bytes + small.rope_bytes + small.kv_bytes + small.activation_bytes + small.overhead_bytes)
