"""A float checkpoint whose weights the asked format cannot hold (a NaN, an inf, a value past float16's range) is a
ModelLoadError naming the weight: a block format said only "weight: q4_1 stores its scales ...", which of the model's
hundreds of weights left to the reader, and float16 packed the NaN or the inf (every output it fed NaN) silently."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import AsyncEngine, ModelLoadError
from tests.helpers import tiny_hf_model, write_gemma_gguf

KV = {"max_model_len": 64, "kv_cache_memory": 1 << 22}


@pytest.mark.parametrize(("quantization", "value"), [
    ("q4_1", float("nan")), ("q8_0", 1e6), ("q4_0", float("inf")),
    ("float16", float("nan")), ("float16", 1e6), ("float16", float("-inf")), ("int8", float("inf")),
])
async def test_a_weight_no_block_can_hold_is_refused_naming_it(tmp_path, quantization: str, value: float) -> None:
    model = tiny_hf_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 5] = value
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as caught:
        await AsyncEngine.load(tmp_path, quantization=quantization, **KV)
    assert f"layers.1.attn.o_proj.weight cannot be quantized to {quantization}" in str(caught.value)  # (its name here)


@pytest.mark.parametrize("quantization", ["float16", "q8_0"])
async def test_a_gguf_float_tensor_the_format_cannot_hold_is_refused_naming_it(tmp_path, quantization: str) -> None:
    """The same from a GGUF file's float32 tensor, built a tensor at a time from the file."""
    model = tiny_hf_model("gemma2")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[1, 2] = float("nan")
    path = write_gemma_gguf(model, tmp_path / "nan.gguf")
    with pytest.raises(ModelLoadError) as caught:
        await AsyncEngine.load(path, quantization=quantization, **KV)
    assert f"layers.0.mlp.down_proj.weight cannot be quantized to {quantization}" in str(caught.value)


async def test_float16_takes_its_largest_value(tmp_path) -> None:
    """65504 is float16's largest finite value: a weight of exactly that loads."""
    model = tiny_hf_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 5] = 65504.0
    model.save_pretrained(tmp_path)
    async with await AsyncEngine.load(tmp_path, quantization="float16", **KV) as engine:
        assert engine.config.quantization == "float16"


@pytest.mark.parametrize("quantization", ["float16", "q8_0", "q4_1"])
async def test_a_weight_that_rounds_to_65504_loads_and_one_that_rounds_to_inf_does_not(tmp_path, quantization) -> None:
    """float16 rounds to nearest: 65519 is stored as 65504, its nearest float16 (no infinity to fear), so it loads;
    65520 rounds to an infinity and is refused, naming the weight."""
    for value, loads in ((65519.0, True), (-65519.0, True), (65520.0, False)):
        model = tiny_hf_model("llama")
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.weight[3, 5] = value
        path = tmp_path / f"{quantization}_{value:g}"
        model.save_pretrained(path)
        if loads:
            async with await AsyncEngine.load(path, quantization=quantization, **KV) as engine:
                assert engine.config.quantization == quantization
        else:
            with pytest.raises(ModelLoadError, match="layers.1.attn.o_proj.weight cannot be quantized"):
                await AsyncEngine.load(path, quantization=quantization, **KV)


async def test_dtype_float16_refuses_a_weight_it_would_turn_into_an_infinity(tmp_path) -> None:
    """``dtype="float16"`` (the model's float weights converted, not a weight format): a weight of 1e5 became an inf
    without a word, and every answer NaN logprobs and token 0 repeated (pass42). Refused, naming the tensor; a weight
    that rounds to 65504 still loads, and bfloat16 takes the 1e5."""
    model = tiny_hf_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[2, 3] = 1e5
    model.save_pretrained(tmp_path / "big")
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.down_proj.weight'.*float16 cannot hold"):
        await AsyncEngine.load(tmp_path / "big", dtype="float16", **KV)
    async with await AsyncEngine.load(tmp_path / "big", dtype="bfloat16", **KV) as engine:
        assert engine.config.dtype == torch.bfloat16
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[2, 3] = 65519.0
    model.save_pretrained(tmp_path / "edge")
    async with await AsyncEngine.load(tmp_path / "edge", dtype="float16", **KV) as engine:
        assert engine.config.dtype == torch.float16
