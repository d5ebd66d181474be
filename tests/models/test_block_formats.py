"""ggml's block formats beyond Q4_1 / Q8_0 on asyncinfer's kernels: Q4_0, Q5_0, Q5_1 and the k-quants Q4_K,
Q5_K, Q6_K (every format where a check covers them all). Their layouts are gguf's, their blocks dequantize
bit for bit as gguf's reference does (the test oracle), the 32-weight formats requantize to the blocks
llama.cpp's reference quantisers write, the k-quants' plain quantizer stays within its stated error, the
GEMM equals a float64 dequantize-then-matmul within the stated tolerance at batch 1 and batched, and a
decoder whose projections mix formats tensor by tensor (a Q4_K_M file's) runs in one kernel call with the
torch reference's logits and tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from asyncinfer import kernels
from asyncinfer.kernels import formats
from asyncinfer.models import load_model
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.decode_backends import KernelDecode, ModelOutput, TorchDecode, kernel_decode_blocker
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.quant import (
    _LAYERS,
    BLOCK_FORMATS,
    BlockLinear,
    MixedBlockLinear,
    Q4_KLinear,
    Q5_0Linear,
    Q6_KLinear,
    Q8_0Linear,
    apply_weight_format,
    linear_bytes,
    weight_bytes,
)
from tests.helpers import PagedRunner, tiny_hf_model
from tests.helpers import float_bits as bits

NEW = ("q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
ALL = tuple(formats.LAYOUTS)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert kernels.available(), kernels.unavailable_reason()


def random_blocks(fmt: str, rows: int, blocks: int, seed: int) -> torch.Tensor:
    """Blocks as a file may hold them: any quants, sub-block scales and minimums (random bytes), with finite
    float16 scales (signed where the format allows) and minimums."""
    layout = formats.LAYOUTS[fmt]
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, blocks, layout.nbytes), generator=gen, dtype=torch.uint8)

    def half(at: int, lo: float, hi: float, signed: bool = False) -> None:
        v = torch.rand(rows, blocks, 1, generator=gen) * (hi - lo) + lo
        if signed:
            v = v * torch.where(torch.rand(rows, blocks, 1, generator=gen) < 0.5, -1.0, 1.0)
        b[..., at:at + 2] = v.half().view(torch.uint8)

    half(208 if fmt == "q6_k" else 0, 1e-4, 1e-2, signed=fmt in ("q4_0", "q5_0", "q8_0", "q6_k"))
    if fmt in ("q4_1", "q5_1"):
        half(2, -0.1, 0.0)
    if fmt in ("q4_k", "q5_k"):
        half(2, 1e-4, 1e-2)
    return b.reshape(rows, -1).contiguous()


def test_the_layouts_are_ggmls_and_written_once() -> None:
    for name, layout in formats.LAYOUTS.items():
        qtype = GGMLQuantizationType(layout.ggml_type)
        assert qtype.name.lower() == name
        assert GGML_QUANT_SIZES[qtype] == (layout.weights, layout.nbytes)
        assert formats.BY_GGML_TYPE[layout.ggml_type] == name
        assert kernels.BLOCK_FORMATS[name] == (layout.weights, layout.nbytes)
        assert formats.block_weights(name) == layout.weights and formats.bytes_per_block(name) == layout.nbytes
    assert set(BLOCK_FORMATS) == set(ALL) and all(_LAYERS[fmt].fmt == fmt for fmt in ALL)
    assert {name for name, layout in formats.LAYOUTS.items() if layout.weights == kernels.QK_K} == {"q4_k", "q5_k",
                                                                                                    "q6_k"}


@pytest.mark.parametrize("fmt", ALL)
def test_blocks_dequantize_bit_for_bit_as_ggufs_reference(fmt) -> None:
    layout = formats.LAYOUTS[fmt]
    blocks = random_blocks(fmt, 6, 3, seed=layout.code)
    ours = kernels.dequantize(blocks, fmt)
    theirs = np.ascontiguousarray(gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType(layout.ggml_type)),
                                  dtype=np.float32)
    assert ours.shape == (6, 3 * layout.weights) and ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.reshape(6, -1).view(np.uint32))  # bits, signs of 0


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q8_0"])
def test_the_reference_quantisers_blocks_come_back_from_their_weights(fmt) -> None:
    """gguf's (llama.cpp's reference) quantiser writes blocks; their dequantized weights quantize back to
    those very bytes (the round trip the loader relies on for a file in these formats)."""
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    theirs = torch.from_numpy(gguf_quants.quantize(w.numpy(), GGMLQuantizationType(formats.LAYOUTS[fmt].ggml_type)))
    assert torch.equal(kernels.quantize(kernels.dequantize(theirs, fmt), fmt), theirs)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_the_32_weight_formats_requantize_their_own_blocks_to_themselves(fmt) -> None:
    w = torch.randn(24, 320, generator=torch.Generator().manual_seed(2)) * 0.05
    blocks = kernels.quantize(w, fmt)
    assert blocks.shape == (24, 10 * formats.LAYOUTS[fmt].nbytes)
    assert torch.equal(kernels.quantize(kernels.dequantize(blocks, fmt), fmt), blocks)
    back = kernels.dequantize(blocks, fmt).view(24, 10, 32)
    levels = {"q4_0": 16, "q4_1": 15, "q5_0": 32, "q5_1": 31, "q8_0": 254}[fmt]
    span = w.view(24, 10, 32).amax(-1, keepdim=True) - w.view(24, 10, 32).amin(-1, keepdim=True)
    if fmt in ("q4_0", "q5_0", "q8_0"):  # symmetric: the step is 2 max |w| / levels
        span = 2 * w.view(24, 10, 32).abs().amax(-1, keepdim=True)
    # Q4_0 / Q5_0 put the largest magnitude at q = 0: a value of the other sign as large is clamped one step short.
    within = 1.01 if fmt in ("q4_0", "q5_0") else 0.51
    assert ((back - w.view(24, 10, 32)).abs() <= span / levels * within + 1e-6).all()


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_the_k_quants_plain_quantizer_stays_within_its_stated_error(fmt) -> None:
    """docs/formats.md: Q4_K / Q5_K within half a step of the sub-block plus half the super-block's minimum
    step (its minimums are rounded to 6 bits); Q6_K within one step of its 16 weights (the int8 scale is
    rounded away from zero, so the extremes fit)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(8, 512, generator=gen) * 0.05 + torch.randn(8, 1, generator=gen) * 0.02
    w[0, :32] *= 20  # one sub-block far wider than the rest of its super-block
    blocks = kernels.quantize(w, fmt)
    assert blocks.shape == (8, 2 * formats.LAYOUTS[fmt].nbytes)
    err = (kernels.dequantize(blocks, fmt) - w).abs()
    if fmt == "q6_k":
        sub = w.view(8, 2, 16, 16)
        step = sub.abs().amax(-1) / 32  # [8, 2, 16]: the sub-block's s
        bound = step + step.amax(-1, keepdim=True) / 128  # d * |sc| <= |s| + |d|
        assert (err.view(8, 2, 16, 16) <= bound[..., None] * 1.01 + 1e-7).all()
    else:
        levels = 15 if fmt == "q4_k" else 31
        sub = w.view(8, 2, 8, 32)
        lo = sub.amin(-1).clamp(max=0)
        span = (sub.amax(-1) - lo) / levels  # [8, 2, 8]
        d, dmin = span.amax(-1, keepdim=True) / 63, (-lo).amax(-1, keepdim=True) / 63
        bound = 0.5 * (span + d) + 0.5 * dmin  # d * sc <= span + d (sc rounded up)
        assert (err.view(8, 2, 8, 32) <= bound[..., None] * 1.01 + 1e-7).all()
    assert (err.norm() / w.norm()).item() < {"q4_k": 0.12, "q5_k": 0.06, "q6_k": 0.04}[fmt]


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 10, 33])
def test_gemm_equals_float64_within_its_activation_rounding(fmt, rows) -> None:
    """Below PANEL_MIN_ROWS rows activations are rounded per run of 32 to int16 (a relative error of the
    result between 1e-6 and 2e-4); from it on the AVX-512 variants keep that rounding (their int16 tile), the
    others keep them float32 (below 1e-6: the panel). A row's result never depends on the other rows of a call
    on the same side of that count."""
    layout = formats.LAYOUTS[fmt]
    k = 768 if layout.weights == 256 else 576
    gen = torch.Generator().manual_seed(rows)
    blocks = random_blocks(fmt, 70, k // layout.weights, seed=rows + layout.code)
    w = kernels.dequantize(blocks, fmt).double()
    x = torch.randn(rows, 1000, generator=gen)[:, 100:100 + k]  # a strided view, as a slice of a bigger tensor
    bias = torch.randn(70, generator=gen)
    ref = x.double() @ w.T + bias.double()
    packed = kernels.pack(blocks, fmt)
    assert packed.data_ptr() == blocks.data_ptr() and torch.equal(kernels.unpack(packed, fmt), blocks)  # ggml's own
    out = kernels.gemm(x, packed, fmt, 70, bias)
    assert out.shape == (rows, 70) and out.dtype == torch.float32
    error = ((out.double() - ref).norm() / ref.norm()).item()
    if rows < kernels.PANEL_MIN_ROWS:
        assert 1e-6 < error < 2e-4, error
        assert torch.equal(out[0], kernels.gemm(x[:1], packed, fmt, 70, bias)[0])
    else:
        if kernels.int16_batched() == "tile":  # the AVX-512 variants: int16 activations here too
            assert 1e-6 < error < 2e-4, error
        else:  # the float32 panel
            assert error < 1e-6, error
        first = kernels.PANEL_MIN_ROWS
        assert torch.equal(out[:first], kernels.gemm(x[:first], packed, fmt, 70, bias))
    assert kernels.gemm(x[:0], packed, fmt, 70).shape == (0, 70)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_gemm_refuses_inputs_that_are_not_whole_super_blocks(fmt) -> None:
    packed = random_blocks(fmt, 4, 1, seed=0)  # 256 inputs a row
    with pytest.raises(ValueError, match="x has 288 columns"):
        kernels.gemm(torch.zeros(1, 288), packed, fmt, 4)
    with pytest.raises(ValueError, match="x has 32 columns"):
        kernels.gemm(torch.zeros(1, 32), packed, fmt, 4)
    with pytest.raises(ValueError, match=r"packed: .* multiple of 256"):  # no block can hold 32 inputs
        kernels.gemm(torch.zeros(1, 32), torch.zeros(4, 0, dtype=torch.uint8), fmt, 4)
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.quantize(torch.zeros(2, 288), fmt)
    with pytest.raises(TypeError, match="x"):
        kernels.gemm(torch.zeros(1, 256, dtype=torch.float64), packed, fmt, 4)


def test_a_decoder_layer_takes_projections_in_any_format_and_mixed_by_rows() -> None:
    """One layer whose q/k in Q4_K and v in Q6_K (one projection of three parts), o and gate_up in Q4_K,
    down in Q6_K: equal to the same steps run op by op with gemm, rms_norm and decode_attention."""
    gen = torch.Generator().manual_seed(11)
    hidden, heads, kv_heads, head_dim, inter = 256, 4, 2, 64, 512
    q_size, kv_size = heads * head_dim, kv_heads * head_dim

    def w(rows: int, k: int, fmt: str) -> torch.Tensor:
        return kernels.quantize(torch.randn(rows, k, generator=gen) * 0.05, fmt)

    parts = (w(q_size, hidden, "q4_k"), w(kv_size, hidden, "q4_k"), w(kv_size, hidden, "q6_k"))
    bias = torch.randn(q_size + 2 * kv_size, generator=gen) * 0.1
    o, gate_up, down = w(hidden, q_size, "q4_k"), w(2 * inter, hidden, "q4_k"), w(hidden, inter, "q6_k")
    norm1, norm2 = 1 + 0.1 * torch.randn(hidden, generator=gen), 1 + 0.1 * torch.randn(hidden, generator=gen)
    layer = kernels.DecodeLayer(norm1=norm1, norm2=norm2, eps=1e-5, qkv=(("q4_k", "q4_k", "q6_k"), parts, bias),
                                o=("q4_k", o, None), gate_up=("q4_k", gate_up, None), down=("q6_k", down, None),
                                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
                                scale=head_dim ** -0.5)
    tokens = 2
    h = torch.randn(tokens, hidden, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    k_cache, v_cache = torch.randn(4, 16, kv_heads, head_dim, generator=gen), torch.randn(4, 16, kv_heads, head_dim,
                                                                                          generator=gen)
    tables, lens = torch.tensor([[2, 0], [1, 3]]), torch.tensor([20, 7])
    slots = torch.tensor([0 * 16 + 3, 1 * 16 + 6])  # the last position of each context
    # op by op
    x = kernels.rms_norm(h, norm1, 1e-5)
    qkv = torch.cat([kernels.gemm(x, p, f, p.shape[0]) for p, f in zip(parts, ("q4_k", "q4_k", "q6_k"))], 1) + bias
    qk = qkv[:, :q_size + kv_size].reshape(tokens, heads + kv_heads, head_dim)
    x1, x2 = qk[..., :head_dim // 2], qk[..., head_dim // 2:]
    c, s = cos[:, None], sin[:, None]
    qk = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    kc, vc = k_cache.clone().view(-1, kv_heads, head_dim), v_cache.clone().view(-1, kv_heads, head_dim)
    kc[slots] = qk[:, heads:]
    vc[slots] = qkv[:, q_size + kv_size:].reshape(tokens, kv_heads, head_dim)
    attn = kernels.decode_attention(qk[:, :heads].contiguous(), kc.view_as(k_cache), vc.view_as(v_cache), tables, lens,
                                    head_dim ** -0.5)
    ref = h + kernels.gemm(attn.reshape(tokens, q_size), o, "q4_k", hidden)
    gu = kernels.gemm(kernels.rms_norm(ref, norm2, 1e-5), gate_up, "q4_k", 2 * inter)
    ref = ref + kernels.gemm(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], down, "q6_k", hidden)
    got = layer(h.clone(), cos, sin, k_cache, v_cache, slots, tables, lens)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim), kc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_quantization_takes_every_block_format_with_llama_cpps_fallbacks() -> None:
    """quantization="q4_k" on a model whose hidden size (64) is not a multiple of 256: those projections
    take Q5_0 (llama.cpp's fallback), the 256-input down projection Q4_K, the head Q6_K's fallback Q8_0;
    weight_bytes counts exactly what apply_weight_format leaves."""
    config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=256, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                         attention_bias=False, bos_token_id=None, eos_token_ids=(0,))
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    nbytes = apply_weight_format(model, "q4_k")
    layer = model.layers[0]
    assert isinstance(layer.attn.qkv_proj, Q5_0Linear) and isinstance(layer.mlp.gate_up_proj, Q5_0Linear)
    assert isinstance(layer.mlp.down_proj, Q4_KLinear) and isinstance(model.output_proj, Q8_0Linear)
    assert nbytes == weight_bytes(config, 4, "q4_k") - sum(p.numel() * 4 for p in model.parameters())  # the rest
    assert linear_bytes("q4_k", 64, 512, bias=True) == 64 * 2 * 144 + 4 * 64
    assert linear_bytes("q6_k", 10, 256, bias=False) == 10 * 210
    assert kernel_decode_blocker(model) is None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_q4_k_m_mix_decodes_in_one_call_as_the_torch_reference(tmp_path, kind) -> None:
    """A model laid out as llama.cpp's Q4_K_M: q/k in Q4_K and v in Q6_K (qkv_proj a MixedBlockLinear), o and
    gate/up in Q4_K, down and the head in Q6_K. KernelDecode (one call a step) and TorchDecode (op by op, the
    same blocks) agree within float32 rounding and pick the same greedy tokens; q/k/v bias included (qwen2)."""
    hf = tiny_hf_model(kind, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(tmp_path, torch.float32, "cpu").model
    q_size, kv_size = 256, 128
    for layer in model.layers:
        qkv = layer.attn.qkv_proj
        bias = qkv.bias
        cut = (0, q_size, q_size + kv_size, q_size + 2 * kv_size)
        parts = [cls(qkv.weight[a:b], None if bias is None else bias[a:b])
                 for cls, a, b in zip((Q4_KLinear, Q4_KLinear, Q6_KLinear), cut, cut[1:])]
        layer.attn.qkv_proj = MixedBlockLinear(parts)
        layer.attn.o_proj = Q4_KLinear(layer.attn.o_proj.weight, None)
        layer.mlp.gate_up_proj = Q4_KLinear(layer.mlp.gate_up_proj.weight, None)
        layer.mlp.down_proj = Q6_KLinear(layer.mlp.down_proj.weight, None)
    model.use_output_proj(Q6_KLinear(model.lm_head_weight, None))
    mixed = model.layers[0].attn.qkv_proj
    assert mixed.kernel_weights()[0] == ("q4_k", "q4_k", "q6_k") and mixed.out_features == q_size + 2 * kv_size
    x = torch.randn(3, 256)
    dense = torch.cat([kernels.dequantize(kernels.unpack(p.kernel_weights()[1], p.fmt), p.fmt) for p in mixed.parts])
    expected = x @ dense.T + (0 if mixed.kernel_weights()[2] is None else mixed.kernel_weights()[2])
    torch.testing.assert_close(mixed(x), expected, rtol=1e-3, atol=1e-3)
    assert kernel_decode_blocker(model) is None
    cpu = torch.device("cpu")
    kernel, reference = KernelDecode(model, KernelDecodeSdpaBackend(), cpu), TorchDecode(model, SdpaBackend(), cpu)
    assert kernel.stack.head[0] == "q6_k"
    prompts = [list(range(3 + i, 9 + 3 * i)) for i in range(6)]
    fused, plain = PagedRunner(model, seed=1), PagedRunner(model, seed=1)
    for batch in (1, 6):
        seqs = range(10 * batch, 10 * batch + batch)
        work = list(zip(seqs, prompts[:batch]))
        first = kernel.forward(fused.step_batch(work, last_only=True), fused.kv_caches)
        second = reference.forward(plain.step_batch(work, last_only=True), plain.kv_caches)
        torch.testing.assert_close(first.logits, second.logits, rtol=0, atol=0)  # a prefill: the reference
        last = first.logits.argmax(dim=-1).tolist()
        for _ in range(4):
            work = [(s, [t]) for s, t in zip(seqs, last)]
            a, b = kernel.forward(fused.step_batch(work), fused.kv_caches), reference.forward(
                plain.step_batch(work), plain.kv_caches)
            assert type(a) is ModelOutput and a.greedy_ids is not None and b.greedy_ids is None
            # a decode step's stated tolerance (docs/formats.md, "Kernel variants"): 1e-3 of the largest logit;
            # the two paths' attention and norms differ in float32 rounding, which can flip an int16 rounding
            # of a later projection's input (measured: up to 1.6e-3 absolute at logits of 5)
            torch.testing.assert_close(a.logits, b.logits, atol=1e-3 * b.logits.abs().max().item(), rtol=1e-3)
            assert a.greedy_ids == a.logits.argmax(dim=-1).tolist() == b.logits.argmax(dim=-1).tolist()
            last = a.greedy_ids


def test_a_mixed_projection_refuses_parts_that_do_not_fit() -> None:
    a = Q4_KLinear(torch.randn(8, 256), None)
    with pytest.raises(ValueError, match="parts"):
        MixedBlockLinear([])
    with pytest.raises(ValueError, match="parts"):
        MixedBlockLinear([a] * 4)
    with pytest.raises(TypeError, match=r"parts\[1\]"):
        MixedBlockLinear([a, torch.nn.Linear(256, 8)])
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        MixedBlockLinear([a, Q8_0Linear(torch.randn(8, 64), None)])
    assert isinstance(a, BlockLinear) and not a.lossless  # the plain quantizer on float weights rounds them


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("bad", [1e5, 1e7, -7e4, float("inf"), float("nan")])
def test_quantize_refuses_weights_whose_scales_overflow_float16(fmt: str, bad: float) -> None:
    """Every scale and minimum is a float16: weights beyond its range would give inf/NaN blocks silently."""
    per = formats.BLOCK_FORMATS[fmt][0]
    weight = torch.zeros(2, per)
    weight[1, 3] = bad
    with pytest.raises(ValueError, match=r"weight: .*\|w\| < 65520"):
        formats.quantize(weight, fmt)
    for edge in (65504.0, 65519.0, -65519.0):  # float16's largest value, and the last ones that round to it
        weight[1, 3] = edge
        assert torch.isfinite(formats.dequantize(formats.quantize(weight, fmt), fmt)).all()
    weight[1, 3] = 65520.0  # rounds to an infinity
    with pytest.raises(ValueError, match=r"weight: .*\|w\| < 65520"):
        formats.quantize(weight, fmt)


@pytest.mark.parametrize("fmt", list(formats.LAYOUTS))
def test_a_block_table_dequantizes_exactly_the_rows_asked_for(fmt) -> None:
    """kernels.BlockTable (an embedding kept in blocks): the rows of any ids, in ggml's order or the kernels'
    layout, are bit for bit those rows of the whole matrix's dequantization; bad ids and blocks are refused."""
    per, size = formats.BLOCK_FORMATS[fmt]
    blocks = random_blocks(fmt, 40, 512 // per, seed=7)  # [40, bytes per row]: 40 rows of 512 weights
    whole = kernels.dequantize(blocks, fmt)  # float32 [40, 512]
    ids = torch.tensor([39, 0, 5, 5, 17])
    for table in (kernels.BlockTable(blocks, fmt), kernels.BlockTable(kernels.pack(blocks, fmt), fmt, packed=True)):
        assert table.shape == (40, 512) and table.nbytes == 40 * 512 // per * size
        assert torch.equal(table.rows(ids), whole[ids])
        assert torch.equal(table.rows(torch.arange(40, dtype=torch.int32)), whole)
        assert table.rows(ids[:0]).shape == (0, 512)
        for bad in (40, -1):
            with pytest.raises(IndexError, match=r"ids: a row index is outside the table \[0, 40\)"):
                table.rows(torch.tensor([1, bad]))
    with pytest.raises(TypeError, match="blocks must be a torch.uint8 tensor"):
        kernels.BlockTable(whole, fmt)
    with pytest.raises(ValueError, match=f"a multiple of {size} bytes"):
        kernels.BlockTable(blocks[:, 1:].contiguous(), fmt)
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.BlockTable(blocks[:, :size], fmt)  # one block of each row's two or more
    with pytest.raises(ValueError, match="unknown block format"):
        kernels.BlockTable(blocks, "q3_k")


@pytest.mark.parametrize("fmt", list(formats.LAYOUTS))
def test_the_kernels_embed_rows_bit_for_bit_from_every_block_format(fmt) -> None:
    """kernels.embed_rows (the decode stack's first step, in C): a BlockTable's rows in ggml's order and in the
    kernels' layout, and a float32 table's, are bit for bit the whole matrix's dequantization (what the torch
    reference's BlockTable.rows gives); a scale (Gemma's sqrt(hidden), rounded to float32) multiplies each value
    as float32 does; ids outside the table and tables the kernels do not read are refused by name."""
    per, _ = formats.BLOCK_FORMATS[fmt]
    blocks = random_blocks(fmt, 40, 512 // per, seed=11)  # signed scales: zeros of both signs among the values
    whole = kernels.dequantize(blocks, fmt)  # float32 [40, 512]
    ids = torch.tensor([39, 0, 5, 5, 17, 39])
    scale = float(torch.tensor(512**0.5, dtype=torch.float32))
    wider = torch.cat([whole, torch.full((40, 8), 7.0)], dim=1)[:, :512]  # rows 520 floats apart
    tables = (kernels.BlockTable(blocks, fmt), kernels.BlockTable(kernels.pack(blocks, fmt), fmt, packed=True),
              whole, wider)
    for table in tables:
        assert torch.equal(bits(kernels.embed_rows(table, ids)), bits(whole[ids]))
        assert torch.equal(bits(kernels.embed_rows(table, torch.arange(40))), bits(whole))
        assert torch.equal(bits(kernels.embed_rows(table, ids, scale)), bits(whole[ids] * scale))
        assert kernels.embed_rows(table, ids[:0]).shape == (0, 512)
        if isinstance(table, kernels.BlockTable):  # the torch reference's rows: the same bits
            assert torch.equal(bits(table.rows(ids)), bits(whole[ids]))
        for bad in (40, -1, 2**62):
            with pytest.raises(IndexError, match=r"ids: a token id is outside the table \[0, 40\)"):
                kernels.embed_rows(table, torch.tensor([1, bad]))
    table = tables[0]
    with pytest.raises(TypeError, match="ids must be a torch.int64 tensor"):
        kernels.embed_rows(table, ids.int())
    with pytest.raises(TypeError, match="ids must be int64 \\[n\\]"):
        kernels.embed_rows(table, ids.view(2, 3))
    with pytest.raises(ValueError, match="scale must be a finite float32"):
        kernels.embed_rows(table, ids, float("nan"))
    with pytest.raises(TypeError, match="scale must be a real number"):
        kernels.embed_rows(table, ids, "2")
    with pytest.raises(TypeError, match="table: embed_rows reads a BlockTable or a float32"):
        kernels.embed_rows(whole.half(), ids)
    with pytest.raises(TypeError, match="table must be a CPU torch.Tensor or a BlockTable"):
        kernels.embed_rows(blocks.tolist(), ids)
    table.fmt = "q3_k"  # a table changed under its checks: refused, never read
    with pytest.raises(ValueError, match="table's format: unknown block format 'q3_k'"):
        kernels.embed_rows(table, ids)
