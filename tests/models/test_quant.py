"""int8 weights: the kernel's error is bounded, the engine serves with it, bad options are refused,
and the one weight-size calculation counts what loading (and quantizing) really leaves."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.models import load_model
from asyncinfer.models.quant import Int8DynamicLinear, quantize_int8, weight_bytes
from tests.helpers import SMOLLM2


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
    # Planning before loading and loading agree, for the same options.
    assert AsyncEngine.plan_memory(tmp_path, **opts, quantization="int8") == int8.memory_plan
    assert AsyncEngine.plan_memory(tmp_path, **opts) == fp32.memory_plan
    async with int8:
        out = await int8.generate([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def stored_bytes(model: torch.nn.Module) -> int:
    """What a loaded model holds: its float parameters, plus what each int8 layer's packed params
    keep: the int8 weight values, one float32 scale per output channel, the float32 bias."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Int8DynamicLinear):
            weight, bias = torch.ops.quantized.linear_unpack(module._packed)
            assert weight.dtype == torch.qint8 and weight.element_size() == 1
            total += weight.numel() + 4 * weight.q_per_channel_scales().numel()
            total += 0 if bias is None else bias.numel() * bias.element_size()
    return total


@pytest.mark.parametrize("quantization, skip", [(None, ()), ("int8", ("down_proj",)), ("int8", ())])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied head, no bias / tied head, q/k/v bias
def test_weight_bytes_from_the_config_equal_the_loaded_model(tmp_path, tiny_pair, kind, quantization, skip) -> None:
    hf, _ = tiny_pair(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, torch.float32, "cpu")
    planned = weight_bytes(loaded.config, 4, quantization, skip)
    if quantization == "int8":
        quantize_int8(loaded.model, skip)
    assert planned == stored_bytes(loaded.model)
    assert weight_bytes(loaded.config, 4, quantization, skip) == planned  # asking twice changes nothing


def test_weight_bytes_of_smollm2() -> None:
    assert weight_bytes(SMOLLM2, 4) == 538_060_032  # 134,515,008 parameters in float32
    # Per layer, int8 q/k/v (960 x 576), o (576 x 576) and gate/up (3072 x 576) with a float32 scale per
    # row, float32 down (576 x 1536) and norms: 6,216,192 bytes; x 30, + the float32 embedding
    # (113,246,208, kept for lookups) and final norm (2,304), + the int8 tied head (28,508,160).
    assert weight_bytes(SMOLLM2, 4, "int8", ("down_proj",)) == 328_242_432
    assert weight_bytes(SMOLLM2, 4, "int8", ()) == 328_242_432 - 30 * (576 * 1536 * 4 - (576 * 1536 + 4 * 576))
    with pytest.raises(InvalidParameterError, match="quantization"):
        weight_bytes(SMOLLM2, 4, "int4")
