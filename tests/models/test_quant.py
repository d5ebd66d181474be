"""int8 weights: the kernel is exact integer arithmetic (so its error vs float is only rounding), the
engine serves the int8 model's own tokens, bad options are refused, and the one weight-size
calculation counts what loading (and quantizing) really leaves."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.models import load_model
from asyncinfer.models.quant import Int8DynamicLinear, quantize_int8, weight_bytes
from tests.helpers import SMOLLM2, PagedRunner


def int8_reference(layer: Int8DynamicLinear, x: torch.Tensor) -> torch.Tensor:
    """What ``layer(x)`` computes, in exact integer arithmetic: ``x`` quantized per tensor to uint8 with
    the kernel's own choice of scale and zero point, times the layer's int8 weights, accumulated in
    int64, then scaled back (float64) and the bias added."""
    weight, bias = torch.ops.quantized.linear_unpack(layer._packed)
    scale, zero_point = torch._choose_qparams_per_tensor(x, False)  # reduce_range=False, as the layer
    xq = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8).int_repr().long() - zero_point
    acc = xq @ weight.int_repr().long().T  # [T, out], exact
    out = scale * acc.double() * weight.q_per_channel_scales().double()
    return out if bias is None else out + bias.double()


def no_saturation_weights(out_features: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """Weights whose int8 values can never saturate the kernel's int16 pair sums, on any x86 CPU.

    Without VNNI, fbgemm multiplies uint8 activations by int8 weights two input columns at a time
    (vpmaddubsw) and saturates each pair's sum to int16. Here every row has one outlier (2c) whose
    pair partner is 0 and every other weight is within [-c, c]: after per-row scaling the outlier is
    +-127 and the rest at most 64 in magnitude, so any pair is at most 255 * 128 = 32640 < 32767.
    With VNNI (int32 accumulation) nothing saturates anyway: the layer's result is the same exact
    integer arithmetic everywhere.
    """
    c = 0.1
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).clamp(-c, c)
    rows = torch.arange(out_features)
    col = torch.randint(0, in_features // 2, (out_features,), generator=gen) * 2
    w[rows, col] = 2 * c * torch.where(torch.rand(out_features, generator=gen) < 0.5, -1.0, 1.0)
    w[rows, col + 1] = 0.0
    return w


def test_int8_linear_is_exact_integer_arithmetic_and_close_to_float() -> None:
    gen = torch.Generator().manual_seed(0)
    w = no_saturation_weights(96, 64, gen)
    b, x = torch.randn(96, generator=gen) * 0.1, torch.randn(7, 64, generator=gen)
    layer = Int8DynamicLinear(w, b)
    wq = torch.ops.quantized.linear_unpack(layer._packed)[0].int_repr().long()
    assert (wq[:, 0::2].abs() + wq[:, 1::2].abs()).max() <= 128  # the pairs stay clear of int16 saturation
    out = layer(x)
    torch.testing.assert_close(out.double(), int8_reference(layer, x), atol=1e-6, rtol=1e-6)
    # The only error left is rounding weights and activations to 8 bits: about 1% here, whatever the CPU.
    ref = torch.nn.functional.linear(x, w, b)
    rel = (out - ref).norm() / ref.norm()
    assert 0.002 < rel < 0.02, rel


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


def int8_stored_bytes(model: torch.nn.Module) -> int:
    """Bytes the int8 layers of ``model`` hold, read back from their packed parameters."""
    return stored_bytes(model) - sum(p.numel() * p.element_size() for p in model.parameters())


def test_quantize_replaces_linears_and_the_tied_head(tiny_pair) -> None:
    _, ours = tiny_pair("qwen2")  # tied embeddings, q/k/v bias
    model = ours.model
    nbytes = quantize_int8(model, skip=("down_proj",))
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj"))}
    assert kinds == {"Int8DynamicLinear"}
    assert all(isinstance(layer.mlp.down_proj, torch.nn.Linear) for layer in model.layers)
    # Per layer: q/k/v 128 x 64 with bias (8192 + 4 * 128 + 4 * 128), o 64 x 64 (4096 + 4 * 64),
    # gate/up 256 x 64 (16384 + 4 * 256); two layers, and the head 256 x 64 (16384 + 4 * 256).
    assert nbytes == int8_stored_bytes(model) == 2 * (9216 + 4352 + 17408) + 17408 == 79_360
    # The head is the tied embedding, rounded per row to 8 bits, and the logits come from it.
    head = model.output_proj
    assert isinstance(head, Int8DynamicLinear) and (head.out_features, head.in_features) == (256, 64)
    wq = torch.ops.quantized.linear_unpack(head._packed)[0]
    embedding = model.embed_tokens.weight
    step = embedding.abs().amax(dim=1, keepdim=True) / 127
    assert ((wq.dequantize() - embedding).abs() <= step / 2 + 1e-7).all()
    assert embedding.dtype == torch.float32  # the embedding itself stays float for lookups
    hidden = model.embed_tokens(torch.arange(3, 40))
    assert torch.equal(model.compute_logits(hidden), head(hidden))


async def test_engine_serves_int8_and_refuses_it_where_it_cannot_run(tiny_pair, tmp_path) -> None:
    hf, _ = tiny_pair("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    opts = {"kv_cache_memory": 2**22, "max_model_len": 128, "device": "cpu"}
    with pytest.raises(InvalidParameterError, match="quantization"):
        AsyncEngine.from_pretrained(tmp_path, **opts, quantization="int4")
    with pytest.raises(InvalidParameterError, match="quantization"):
        AsyncEngine.from_pretrained(tmp_path, **opts, quantization="int8", dtype="bfloat16")
    fp32 = AsyncEngine.from_pretrained(tmp_path, **opts)
    int8 = AsyncEngine.from_pretrained(tmp_path, **opts, quantization="int8")
    served = int8.core.runner.model
    assert isinstance(served.layers[0].attn.qkv_proj, Int8DynamicLinear)
    assert type(served.layers[0].mlp.down_proj) is torch.nn.Linear  # the default quantization_skip
    # The plan counts what the engine's model really holds; planning before loading agrees.
    assert int8.memory_plan.weight_bytes == stored_bytes(served) < fp32.memory_plan.weight_bytes
    assert AsyncEngine.plan_memory(tmp_path, **opts, quantization="int8") == int8.memory_plan
    assert AsyncEngine.plan_memory(tmp_path, **opts) == fp32.memory_plan
    # The engine's tokens are the int8 model's own, run step by step without the engine (the float
    # model's greedy tokens part from these after eight: serving it instead would show).
    reference = load_model(tmp_path, torch.float32, "cpu").model
    quantize_int8(reference, ("down_proj",))
    prompt = [5, 6, 7, 8]
    expected = PagedRunner(reference, block_size=16).greedy(0, prompt, 12)
    async with int8:
        out = await int8.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.token_ids == expected and out.finish_reason == "length"


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
