"""Weight formats: the int8 kernel is exact integer arithmetic on every x86 CPU (so its error vs float is
only rounding), float16 and packed float32 are float32 up to rounding, the engine serves each format's
own tokens, bad options are refused, and the one weight-size calculation counts what loading (and the
format) really leaves."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.config import EngineConfig
from asyncinfer.models import load_model
from asyncinfer.models.quant import (
    BlockLinear,
    FormatLinear,
    Fp16Linear,
    Int8DynamicLinear,
    PackedLinear,
    apply_weight_format,
    check_quantization,
    default_skip,
    format_dtype,
    fp16_weights_available,
    packed_rows,
    quantize_int8,
    resolve_quantization,
    weight_bytes,
)
from asyncinfer.planner import plan_deployment
from tests.helpers import ENGINE_BASE, SMOLLM2, PagedRunner


def int8_reference(layer: Int8DynamicLinear, x: torch.Tensor) -> torch.Tensor:
    """What ``layer(x)`` computes, in exact integer arithmetic: ``x`` quantized per tensor to uint8 with
    the kernel's own choice of scale and zero point (8 bits: reduce_range=False), times the layer's int8
    weights, accumulated in int64, then scaled back (float64) and the bias added."""
    weight, bias = torch.ops.quantized.linear_unpack(layer._packed)
    scale, zero_point = torch._choose_qparams_per_tensor(x, False)
    xq = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8).int_repr().long() - zero_point
    acc = xq @ weight.int_repr().long().T  # [T, out], exact
    out = scale * acc.double() * weight.q_per_channel_scales().double()
    return out if bias is None else out + bias.double()


def test_int8_linear_is_exact_integer_arithmetic_and_close_to_float() -> None:
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen) * 0.05, torch.randn(96, generator=gen) * 0.1
    x = torch.randn(7, 64, generator=gen)
    layer = Int8DynamicLinear(w, b)
    wq = torch.ops.quantized.linear_unpack(layer._packed)[0].int_repr()
    assert wq.abs().amax(dim=1).eq(64).all()  # each row's largest weight is +-64, none beyond
    out = layer(x)
    torch.testing.assert_close(out.double(), int8_reference(layer, x), atol=1e-6, rtol=1e-6)
    # The only error left is rounding weights (to 7 bits and a sign) and activations (to 8 bits).
    ref = torch.nn.functional.linear(x, w, b)
    rel = (out - ref).norm() / ref.norm()
    assert 0.002 < rel < 0.02, rel


def test_int8_never_saturates_on_any_x86_cpu() -> None:
    """The worst case for AVX2 without VNNI: every pair of products at its largest, of one sign. With weights
    of +-127 (and 8-bit activations) the int16 pair sums would clip at 32767 on such a CPU; with +-64 they
    reach 2 x 255 x 64 = 32640, so every CPU returns the exact integer result."""
    gen = torch.Generator().manual_seed(1)
    sign = torch.where(torch.rand(8, 256, generator=gen) < 0.5, -1.0, 1.0)  # [out, in]
    x = torch.cat([sign * 5.0, sign * -5.0, torch.full((1, 256), 5.0), torch.zeros(1, 256)]).clone()  # [18, in]
    x[:, 0] = -0.01  # a zero point at 1: the largest activations quantize to 255
    layer = Int8DynamicLinear(sign * 0.3, None)
    torch.testing.assert_close(layer(x).double(), int8_reference(layer, x), atol=1e-6, rtol=1e-6)


def stored_bytes(model: torch.nn.Module) -> int:
    """What a loaded model holds, read back from its tensors: its float parameters, plus what each format
    layer's packed weights keep: int8 values and a float32 scale per output channel, float16 values, or
    float32 values in oneDNN's layout; and the float32 bias."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Int8DynamicLinear):
            weight, bias = torch.ops.quantized.linear_unpack(module._packed)
            assert weight.dtype == torch.qint8 and weight.element_size() == 1
            total += weight.numel() + 4 * weight.q_per_channel_scales().numel()
        elif isinstance(module, Fp16Linear):
            weight, bias = torch.ops.quantized.linear_unpack_fp16(module._packed)
            total += 2 * weight.numel()  # fbgemm keeps float16 values; unpacking widens them to float32
        elif isinstance(module, BlockLinear):
            weight, bias = module._blocks, module._bias
            assert weight.dtype == torch.uint8
            total += weight.numel()
        elif isinstance(module, PackedLinear):
            weight, bias = module._packed, module._bias
            assert weight.is_mkldnn and weight.dtype == torch.float32
            total += weight.numel() * weight.element_size()
        else:
            continue
        total += 0 if bias is None else bias.numel() * bias.element_size()
    return total


def int8_stored_bytes(model: torch.nn.Module) -> int:
    """Bytes the format layers of ``model`` hold, read back from their packed parameters."""
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
    # The head is the tied embedding, rounded per row to 7 bits and a sign, and the logits come from it.
    head = model.output_proj
    assert isinstance(head, Int8DynamicLinear) and (head.out_features, head.in_features) == (256, 64)
    wq = torch.ops.quantized.linear_unpack(head._packed)[0]
    embedding = model.embed_tokens.weight
    step = embedding.abs().amax(dim=1, keepdim=True) / 64
    assert ((wq.dequantize() - embedding).abs() <= step / 2 + 1e-7).all()
    assert embedding.dtype == torch.float32  # the embedding itself stays float for lookups
    hidden = model.embed_tokens(torch.arange(3, 40))
    assert torch.equal(model.compute_logits(hidden), head(hidden))


def test_float16_and_packed_layers_are_float32_up_to_rounding() -> None:
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 64, generator=gen) * 0.05, torch.randn(96, generator=gen)
    x = torch.randn(7, 64, generator=gen)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    packed, half = PackedLinear(w, b), Fp16Linear(w, b)
    torch.testing.assert_close(packed(x).double(), ref, atol=1e-5, rtol=1e-5)  # float32 rounding only
    # float16 weights, float32 activations and accumulation: the error is rounding the weights to 11 bits.
    torch.testing.assert_close(half(x).double(), torch.nn.functional.linear(
        x.double(), w.half().double(), b.double()), atol=1e-5, rtol=1e-5)
    assert (packed.nbytes, half.nbytes) == (4 * 96 * 64 + 4 * 96, 2 * 96 * 64 + 4 * 96)


def test_packed_layers_run_a_few_row_counts_whatever_the_input() -> None:
    """oneDNN caches a kernel per row count (~0.6 MB each): a PackedLinear pads its input to at most
    72 row counts up to 2048 rows (at most 12.5% more rows), and the padding never reaches the output."""
    sizes = {packed_rows(rows) for rows in range(1, 2049)}
    assert len(sizes) == 72 and all(packed_rows(r) == r for r in range(1, 17))
    assert all(r <= packed_rows(r) <= r * 1.125 for r in range(1, 5000))
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    packed = PackedLinear(w, b)
    for rows in (1, 16, 17, 45, 100, 300):
        x = torch.randn(rows, 24, generator=gen)
        out = packed(x)
        assert out.shape == (rows, 40) and out.is_contiguous()
        torch.testing.assert_close(out.double(), torch.nn.functional.linear(x.double(), w.double(), b.double()),
                                   atol=1e-5, rtol=1e-5)


def test_each_format_replaces_what_it_should(tiny_pair, tmp_path) -> None:
    _, ours = tiny_pair("llama")  # untied head
    fp16 = apply_weight_format(copy.deepcopy(ours.model), "float16", pack=True)
    packed = copy.deepcopy(ours.model)
    apply_weight_format(packed, None, pack=True)
    int8 = copy.deepcopy(ours.model)
    apply_weight_format(int8, "int8", ("down_proj", "lm_head"), pack=True)
    assert isinstance(packed.layers[1].mlp.down_proj, PackedLinear) and isinstance(packed.output_proj, PackedLinear)
    assert packed.lm_head is None  # the float copy is gone: packing does not double the head
    assert isinstance(int8.layers[0].attn.o_proj, Int8DynamicLinear)
    assert isinstance(int8.layers[0].mlp.down_proj, PackedLinear) and isinstance(int8.output_proj, PackedLinear)
    # Two layers of q/k/v 128 x 64, o 64 x 64, gate/up 256 x 64, down 64 x 128, and the head 256 x 64, at 2 bytes.
    assert fp16 == 2 * 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 2 * 256 * 64 == 180_224
    plain = copy.deepcopy(ours.model)
    assert apply_weight_format(plain, None, pack=False) == 0 and plain.output_proj is None
    hf, _ = tiny_pair("qwen2")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32, "cpu").model  # a fresh copy: tiny_pair's has been quantized
    apply_weight_format(model, None, pack=True)
    assert model.output_proj is None  # a tied head stays the embedding: a packed copy would double it


def test_the_default_format_is_float16_weights_on_a_cpu_when_the_dtype_is_left_auto() -> None:
    """quantization="auto" (the default): float16 weights on an x86 CPU when dtype is "auto" (the
    fastest format whose greedy output equals float32's, benchmarks/quality.py); an explicit dtype,
    quantization=None and CUDA keep the engine dtype."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fp16_weights_available()  # fbgemm: every x86 CPU this project tests on
    assert EngineConfig(device="cpu").quantization == "float16"
    assert EngineConfig(device="cpu").dtype == torch.float32
    assert EngineConfig(device="cpu", dtype="float32").quantization is None
    assert EngineConfig(device="cpu", quantization=None).quantization is None
    assert EngineConfig(device="cpu", quantization="int8").quantization == "int8"
    assert resolve_quantization("auto", cuda, "auto") is None
    assert resolve_quantization("auto", cpu, None) == "float16"
    assert resolve_quantization("auto", cpu, "bfloat16") is None


async def test_the_default_engine_serves_float16_weights(tiny_models) -> None:
    path = tiny_models["llama"][0]
    opts = {"kv_cache_memory": 2**22, "max_model_len": 128, "device": "cpu"}
    default = AsyncEngine.from_pretrained(path, **opts)
    assert isinstance(default.core.runner.model.layers[0].attn.qkv_proj, Fp16Linear)
    assert default.memory_plan == AsyncEngine.plan_memory(path, **opts, quantization="float16")
    explicit = AsyncEngine.from_pretrained(path, **opts, quantization="float16")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    async with default, explicit:
        ours, theirs = await default.generate([5, 6, 7], params), await explicit.generate([5, 6, 7], params)
    assert ours.token_ids == theirs.token_ids


def test_formats_allowed_per_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for method in (None, "float16", "int8", "q8_0", "q4_1", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"):
        check_quantization(method, cpu, torch.float32)
    for method, dtype in ((None, torch.bfloat16), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        check_quantization(method, cuda, dtype)
    refused = [("int8", cuda, torch.bfloat16), ("int8", cuda, torch.float32), ("float16", cuda, torch.bfloat16),
               ("bfloat16", cpu, torch.float32), ("int8", cpu, torch.bfloat16), ("float16", cpu, torch.float16),
               ("int4", cpu, torch.float32), ("fp8", cuda, torch.bfloat16)]
    for method, device, dtype in refused:
        with pytest.raises(InvalidParameterError) as err:
            check_quantization(method, device, dtype)
        assert err.value.parameter == "quantization" and err.value.value == method
        assert ("'bfloat16' on CUDA" if device.type == "cuda" else "'native' on CPU") in str(err.value)
        assert all(f"'{fmt}'" in str(err.value) for fmt in ("q4_1", "q8_0", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "native"))
    # On CUDA a dtype format is the engine dtype: "auto" takes it, an explicit dtype must match.
    with pytest.raises(InvalidParameterError, match="a CPU format needs dtype float32 or 'auto', not bfloat16"):
        check_quantization("float16", cpu, torch.bfloat16)
    assert format_dtype("float16", cuda, "auto") == "float16" and format_dtype("float16", cpu, "auto") == "auto"
    assert format_dtype("bfloat16", cuda, "float32") == "float32"  # then refused by check_quantization
    assert default_skip("int8") == ("down_proj", "lm_head") and default_skip("float16") == default_skip(None) == ()


def test_engine_options_pack_weights_and_skip_defaults(tiny_models) -> None:
    path = tiny_models["llama"][0]
    packed = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    assert packed.config.pack_weights is True and packed.config.quantization_skip == ()
    assert isinstance(packed.core.runner.model.layers[0].attn.qkv_proj, PackedLinear)
    plain = AsyncEngine.from_pretrained(path, **ENGINE_BASE, pack_weights=False)
    assert type(plain.core.runner.model.layers[0].attn.qkv_proj) is torch.nn.Linear
    assert packed.memory_plan.weight_bytes == plain.memory_plan.weight_bytes == stored_bytes(packed.core.runner.model)
    int8 = AsyncEngine.from_pretrained(path, **ENGINE_BASE, quantization="int8")
    assert int8.config.quantization_skip == default_skip("int8")
    for value, extra in (("yes", {}), (True, {"dtype": "bfloat16"}), (1, {})):
        with pytest.raises(InvalidParameterError) as err:
            AsyncEngine.from_pretrained(path, **(ENGINE_BASE | extra), pack_weights=value)
        assert err.value.parameter == "pack_weights"
    with pytest.raises(InvalidParameterError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, quantization="int8", quantization_skip="down_proj")
    assert err.value.parameter == "quantization_skip"


@pytest.mark.parametrize("method", ["int8", "float16"])
async def test_engine_serves_the_formats_own_tokens(tiny_pair, tmp_path, method) -> None:
    hf, _ = tiny_pair("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    opts = {"kv_cache_memory": 2**22, "max_model_len": 128, "device": "cpu"}
    with pytest.raises(InvalidParameterError, match="quantization"):
        AsyncEngine.from_pretrained(tmp_path, **opts, quantization="int4")
    with pytest.raises(InvalidParameterError, match="quantization"):
        AsyncEngine.from_pretrained(tmp_path, **opts, quantization=method, dtype="bfloat16")
    fp32 = AsyncEngine.from_pretrained(tmp_path, **opts, quantization=None)
    engine = AsyncEngine.from_pretrained(tmp_path, **opts, quantization=method)
    served = engine.core.runner.model
    assert isinstance(served.layers[0].attn.qkv_proj, Int8DynamicLinear if method == "int8" else Fp16Linear)
    down = served.layers[0].mlp.down_proj  # int8's default quantization_skip keeps it float32 (packed)
    assert isinstance(down, PackedLinear if method == "int8" else Fp16Linear)
    # The plan counts what the engine's model really holds; planning before loading agrees.
    assert engine.memory_plan.weight_bytes == stored_bytes(served) < fp32.memory_plan.weight_bytes
    assert AsyncEngine.plan_memory(tmp_path, **opts, quantization=method) == engine.memory_plan
    assert AsyncEngine.plan_memory(tmp_path, **opts, quantization=None) == fp32.memory_plan
    assert AsyncEngine.plan_memory(tmp_path, **opts) == (engine.memory_plan if method == "float16" else
                                                         AsyncEngine.plan_memory(tmp_path, **opts, quantization="float16"))
    # The engine's tokens are the format's own model's, run step by step without the engine.
    reference = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(reference, method, engine.config.quantization_skip, pack=engine.config.pack_weights)
    prompt = [5, 6, 7, 8]
    expected = PagedRunner(reference, block_size=16).greedy(0, prompt, 12)
    async with engine:
        out = await engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.token_ids == expected and out.finish_reason == "length"


@pytest.mark.parametrize("quantization, skip", [(None, ()), ("int8", ("down_proj",)), ("int8", ()),
                                                ("float16", ()), ("float16", ("lm_head", "o_proj")),
                                                ("q4_1", ()), ("q8_0", ("o_proj",))])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied head, no bias / tied head, q/k/v bias
@pytest.mark.parametrize("pack", [False, True])
def test_weight_bytes_from_the_config_equal_the_loaded_model(tmp_path, tiny_pair, kind, quantization, skip,
                                                             pack) -> None:
    hf, _ = tiny_pair(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, torch.float32, "cpu")
    planned = weight_bytes(loaded.config, 4, quantization, skip)
    apply_weight_format(loaded.model, quantization, skip, pack=pack)
    assert any(isinstance(m, FormatLinear) for m in loaded.model.modules()) == (pack or quantization is not None)
    assert planned == stored_bytes(loaded.model)
    assert weight_bytes(loaded.config, 4, quantization, skip) == planned  # asking twice changes nothing


def test_weight_bytes_of_smollm2() -> None:
    assert weight_bytes(SMOLLM2, 4) == 538_060_032  # 134,515,008 parameters in float32
    # Per layer, int8 q/k/v (960 x 576), o (576 x 576) and gate/up (3072 x 576) with a float32 scale per
    # row, float32 down (576 x 1536) and norms: 6,216,192 bytes; x 30, + the float32 embedding
    # (113,246,208, kept for lookups) and final norm (2,304), + the int8 tied head (28,508,160).
    assert weight_bytes(SMOLLM2, 4, "int8", ("down_proj",)) == 328_242_432
    # The default skip list also keeps the (tied) head in float32: no int8 copy of the embedding.
    assert weight_bytes(SMOLLM2, 4, "int8", default_skip("int8")) == 328_242_432 - 28_508_160 == 299_734_272
    assert weight_bytes(SMOLLM2, 4, "int8", ()) == 328_242_432 - 30 * (576 * 1536 * 4 - (576 * 1536 + 4 * 576))
    # float16: per layer 3,538,944 projection weights at 2 bytes + the float32 norms (4,608): 7,082,496;
    # x 30, + the float32 embedding and final norm, + the float16 tied head (56,623,104).
    assert weight_bytes(SMOLLM2, 4, "float16") == 30 * 7_082_496 + 113_246_208 + 2_304 + 56_623_104 == 382_346_496
    # On CUDA the formats are dtypes: nothing is replaced, every parameter takes the dtype's bytes.
    assert weight_bytes(SMOLLM2, 2, "float16", (), "cuda") == weight_bytes(SMOLLM2, 2) == 269_030_016
    # q4_1: per layer 3,538,944 projection weights in blocks of 32 at 20 bytes (2,211,840) + the norms:
    # 2,216,448; x 30, + the float32 embedding and final norm, + the Q8_0 tied head (28,311,552 at 34 bytes
    # per 32: 30,081,024).
    assert weight_bytes(SMOLLM2, 4, "q4_1") == 30 * 2_216_448 + 113_246_208 + 2_304 + 30_081_024 == 209_822_976
    assert weight_bytes(SMOLLM2, 4, "q8_0") == 30 * (3_538_944 // 32 * 34 + 4_608) + 113_246_208 + 2_304 + 30_081_024
    with pytest.raises(InvalidParameterError, match="quantization"):
        weight_bytes(SMOLLM2, 4, "int4")


def test_planning_a_cuda_format_sets_the_dtype() -> None:
    plan = plan_deployment(SMOLLM2, device="cuda", quantization="float16", device_memory=8 * 2**30, seq_len=1024)
    assert plan.dtype == torch.float16 and plan.weight_bytes == 269_030_016
    with pytest.raises(InvalidParameterError) as err:
        plan_deployment(SMOLLM2, device="cuda", quantization="int8", device_memory=8 * 2**30)
    assert err.value.parameter == "quantization" and "on CUDA" in str(err.value)
