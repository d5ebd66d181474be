"""int8 weights: the kernel's error is bounded, the engine serves with it, bad options are refused."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.models.quant import Int8DynamicLinear, quantize_int8


def test_int8_linear_is_close_to_float() -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64) * 0.1, torch.randn(96) * 0.1, torch.randn(7, 64)
    ref = torch.nn.functional.linear(x, w, b)
    out = Int8DynamicLinear(w, b)(x)
    assert out.shape == ref.shape
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.02, rel  # 8-bit weights and activations: about 1% error


def test_quantize_replaces_linears_and_the_tied_head(tiny_pair) -> None:
    hf, ours = tiny_pair("qwen2")  # tied embeddings, q/k/v bias
    model = ours.model
    ids = torch.arange(3, 40)
    before = torch.nn.functional.linear(model.embed_tokens(ids), model.lm_head_weight)
    nbytes = quantize_int8(model, skip=("down_proj",))
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj"))}
    assert kinds == {"Int8DynamicLinear"}
    assert all(isinstance(layer.mlp.down_proj, torch.nn.Linear) for layer in model.layers)
    assert model.output_proj is not None and nbytes > 0
    after = model.compute_logits(model.embed_tokens(ids))
    assert ((after - before).norm() / before.norm()) < 0.02


async def test_engine_serves_int8_and_refuses_it_where_it_cannot_run(tiny_pair, tmp_path) -> None:
    hf, ours = tiny_pair("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    opts = dict(kv_cache_memory=2**22, max_model_len=128, device="cpu")
    with pytest.raises(InvalidParameterError, match="quantization"):
        AsyncEngine.from_pretrained(tmp_path, **opts, quantization="int4")
    with pytest.raises(InvalidParameterError, match="quantization"):
        AsyncEngine.from_pretrained(tmp_path, **opts, quantization="int8", dtype="bfloat16")
    fp32 = AsyncEngine.from_pretrained(tmp_path, **opts)
    int8 = AsyncEngine.from_pretrained(tmp_path, **opts, quantization="int8")
    assert int8.memory_plan.weight_bytes < fp32.memory_plan.weight_bytes
    async with int8:
        out = await int8.generate([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
