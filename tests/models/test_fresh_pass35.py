"""pass35: quantizing a float checkpoint that holds a NaN or an inf to int8 (issue 25, the first hour).

The block formats' refusal of such a weight names it since the last stop (``layers.1.attn.o_proj.weight cannot be
quantized to q4_1: ...``); ``quantization="int8"`` still failed in torch's quantizer with ``loading '...' failed: In
ChooseQuantizationParams, min should be less than or equal to max``, naming neither the weight nor what was wrong
with it. It is the same ModelLoadError now; a large finite weight still loads (int8 scales each row).
"""

from __future__ import annotations

import pytest
import torch

from asyncinfer import AsyncEngine, ModelLoadError
from tests.helpers import tiny_hf_model


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
async def test_a_nonfinite_weight_is_refused_by_int8_naming_it(tmp_path, value: float) -> None:
    model = tiny_hf_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 5] = value
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as caught:
        await AsyncEngine.load(tmp_path, quantization="int8", max_model_len=64, kv_cache_memory=1 << 22, num_threads=1)
    message = str(caught.value)
    assert "layers.1.attn.o_proj.weight cannot be quantized to int8" in message and "finite" in message
    assert "ChooseQuantizationParams" not in message


async def test_a_large_finite_weight_still_loads_as_int8(tmp_path) -> None:
    model = tiny_hf_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 5] = 1e6
    model.save_pretrained(tmp_path)
    engine = await AsyncEngine.load(tmp_path, quantization="int8", max_model_len=64, kv_cache_memory=1 << 22,
                                    num_threads=1)
    await engine.aclose()
