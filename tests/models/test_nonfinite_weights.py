"""A float checkpoint whose weights no block of the asked format can hold (a NaN, a value past float16's range) is a
ModelLoadError naming the weight (it said only "weight: q4_1 stores its scales ...", which of the model's hundreds of
weights left to the reader)."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import AsyncEngine, ModelLoadError
from tests.helpers import tiny_hf_model


@pytest.mark.parametrize(("quantization", "value"), [("q4_1", float("nan")), ("q8_0", 1e6), ("q4_0", float("inf"))])
async def test_a_weight_no_block_can_hold_is_refused_naming_it(tmp_path, quantization: str, value: float) -> None:
    model = tiny_hf_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 5] = value
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as caught:
        await AsyncEngine.load(tmp_path, quantization=quantization, max_model_len=64, kv_cache_memory=1 << 22)
    assert f"layers.1.attn.o_proj.weight cannot be quantized to {quantization}" in str(caught.value)  # (its name here)
