"""asyncinfer's own CPU kernels (asyncinfer.kernels): Q4_1 / Q8_0 blocks rebuilt exactly as ggml does,
products within the int16 activation rounding of float64 ones, RMS norm and paged decode attention
equal to torch's up to float32 rounding, the engine serving the block formats' own tokens, and a
clean refusal where the kernels cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams, kernels
from asyncinfer.config import EngineConfig
from asyncinfer.models import load_model
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.decode_backends import KernelDecode, ModelOutput, TorchDecode
from asyncinfer.models.gguf_file import GGUFFile, _dequantize_blocks
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.quant import (
    BlockLinear,
    Q4_1Linear,
    Q8_0Linear,
    apply_weight_format,
    check_quantization,
    smaller_cpu_formats,
)
from tests.helpers import PagedRunner, tiny_hf_model


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    # Every machine this project tests on is x86-64 Linux with AVX2 and a C compiler: the kernels must build.
    assert kernels.available(), kernels.unavailable_reason()


def random_blocks(fmt: str, rows: int, blocks: int, seed: int) -> torch.Tensor:
    """Blocks as llama.cpp's quantisers write them: float16 scales (and minimums), any quants, with each
    block's extremes at the ends of the range (Q4_1: its minimum at q = 0 and maximum at 15; Q8_0: its
    largest magnitude at +-127)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, blocks, 1, generator=gen) * 0.01 + 1e-4).half().view(torch.uint8)  # [rows, B, 2]
    if fmt == "q4_1":
        m = (-torch.rand(rows, blocks, 1, generator=gen) * 0.1).half().view(torch.uint8)
        qs = torch.randint(0, 256, (rows, blocks, 16), generator=gen, dtype=torch.uint8)
        qs[..., 0] = 0xF0  # element 0: q = 0, element 16: q = 15
        parts = (d, m, qs)
    else:
        qs = torch.randint(-127, 128, (rows, blocks, 32), generator=gen, dtype=torch.int8)
        qs[..., 5] = 127
        parts = (d, qs.view(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()


@pytest.mark.parametrize("fmt, ggml_type", [("q4_1", 3), ("q8_0", 8)])
def test_blocks_dequantize_as_ggml_and_requantize_to_themselves(fmt, ggml_type) -> None:
    blocks = random_blocks(fmt, 12, 5, seed=ggml_type)
    ours = kernels.dequantize(blocks, fmt)  # [12, 160]
    theirs = _dequantize_blocks(blocks.reshape(-1, kernels.BLOCK_FORMATS[fmt][1]).numpy(), ggml_type)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs)).view(12, 160))
    # Weights that came from blocks quantize back to the very same bytes: no second rounding.
    assert torch.equal(kernels.quantize(ours, fmt), blocks)


@pytest.mark.real_model
def test_the_real_gguf_tensors_requantize_to_the_files_bytes(real_gguf) -> None:
    """SmolLM2's file: Q4_1 projections and a Q8_0 embedding; the float32 model holds their dequantised
    values, and the block formats turn those back into the file's own blocks, byte for byte."""
    gguf = GGUFFile(real_gguf)
    names = {"blk.0.attn_q.weight": "q4_1", "blk.7.ffn_down.weight": "q4_1", "token_embd.weight": "q8_0"}
    for tensor in (t for t in gguf.tensors if t.name in names):
        raw = torch.from_numpy(gguf.raw(tensor).copy()).view(tensor.shape[0], -1)
        assert torch.equal(kernels.quantize(gguf.dequantize(tensor), names[tensor.name]), raw), tensor.name


def test_quantizing_float_weights_rounds_each_block_within_half_a_step() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    for fmt, levels in (("q4_1", 15), ("q8_0", 254)):
        back = kernels.dequantize(kernels.quantize(w, fmt), fmt).view(64, 3, 32)
        span = w.view(64, 3, 32).amax(-1, keepdim=True) - w.view(64, 3, 32).amin(-1, keepdim=True)
        step = span / levels if fmt == "q4_1" else w.view(64, 3, 32).abs().amax(-1, keepdim=True) / 127
        assert ((back - w.view(64, 3, 32)).abs() <= step * 0.51 + 1e-6).all(), fmt
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.quantize(torch.zeros(4, 40), "q4_1")


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 10, 33, 200])
def test_gemm_equals_float64_within_its_activation_rounding(fmt, rows) -> None:
    """Below PANEL_MIN_ROWS rows activations are rounded per block to int16 (a few parts in 100,000 of the
    result); from it on the AVX-512 variants keep that rounding (their int16 tile), the others keep them float32
    (float32 rounding only: the panel). A row's result never depends on the other rows of a call on the same
    side of that count."""
    assert kernels.PANEL_MIN_ROWS == 9
    gen = torch.Generator().manual_seed(rows)
    blocks = random_blocks(fmt, 70, 18, seed=rows)  # 70 x 576
    w = kernels.dequantize(blocks, fmt).double()
    x = torch.randn(rows, 1000, generator=gen)[:, 100:676]  # a strided view, as a slice of a bigger tensor
    bias = torch.randn(70, generator=gen)
    ref = x.double() @ w.T + bias.double()
    packed = kernels.pack(blocks, fmt)
    assert packed.shape == blocks.shape and torch.equal(kernels.unpack(packed, fmt), blocks)
    out = kernels.gemm(x, packed, fmt, 70, bias)
    assert out.shape == (rows, 70) and out.dtype == torch.float32
    error = ((out.double() - ref).norm() / ref.norm()).item()
    if rows < kernels.PANEL_MIN_ROWS:
        assert 1e-6 < error < 2e-4, error  # int16 activations: rounded, and not more than that
        assert torch.equal(out[0], kernels.gemm(x[:1], packed, fmt, 70, bias)[0])
    else:
        if kernels.int16_batched() == "tile":  # the AVX-512 variants: int16 activations here too
            assert 1e-6 < error < 2e-4, error
        else:  # the float32 panel
            assert error < 1e-6, error
        first = kernels.PANEL_MIN_ROWS
        assert torch.equal(out[:first], kernels.gemm(x[:first], packed, fmt, 70, bias))
    assert kernels.gemm(x[:0], packed, fmt, 70).shape == (0, 70)
    with pytest.raises(TypeError, match="float32"):
        kernels.gemm(x.double(), packed, fmt, 70)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_gemm_of_zero_width_activations_is_the_bias(fmt) -> None:
    """An empty dot product is 0: both paths (below and from PANEL_MIN_ROWS rows) give the bias."""
    packed = torch.zeros(4, 0, dtype=torch.uint8)
    bias = torch.arange(4, dtype=torch.float32)
    for rows in (1, kernels.PANEL_MIN_ROWS, 17):
        out = kernels.gemm(torch.zeros(rows, 0), packed, fmt, 4, bias)
        assert torch.equal(out, bias.expand(rows, 4))
        assert torch.equal(kernels.gemm(torch.zeros(rows, 0), packed, fmt, 4), torch.zeros(rows, 4))


def test_rms_norm_equals_the_reference_steps_within_rounding() -> None:
    gen = torch.Generator().manual_seed(5)
    for rows, hidden in ((1, 576), (7, 64), (40, 100)):  # 100: a tail past the last 8-wide vector
        x, weight = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
        reference = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128)])
def test_decode_attention_reads_the_paged_cache_in_place_like_sdpa(heads, kv_heads, head_dim) -> None:
    gen = torch.Generator().manual_seed(heads)
    num_blocks, block_size = 24, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    context = torch.tensor([1, 16, 17, 40, 64])  # one token, a full block, one past it, ragged
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:4] for _ in range(5)])  # [5, 4]
    q = torch.randn(5, heads, head_dim, generator=gen)
    out = kernels.decode_attention(q, k_cache, v_cache, tables, context, 0.3)
    for s, length in enumerate(context.tolist()):
        slots = [tables[s, t // block_size].item() * block_size + t % block_size for t in range(length)]
        keys = k_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)[None]  # [1, KVH, L, D]
        values = v_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[s][None, :, None], keys, values, scale=0.3, enable_gqa=True)
        # float32 rounding of 128-term dot products in another order: every variant (the scalar reference keeps
        # its sums unfused and in order, the SIMD ones fuse them), docs/formats.md's 1e-5 for attention
        torch.testing.assert_close(out[s], ref[0, :, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim, contexts, softcap, window", [
    (7, 1, 64, [300], None, None),  # one group: 7 heads in runs over the threads; 300 keys past the first 256 asked for
    (8, 2, 40, [45, 1, 17], 2.0, None),  # three sequences, D not a multiple of 32 (its tail of 8)
    (6, 1, 16, [33, 290, 5], None, 20),  # D < 32: the values' only walk is the tail's; a window from mid-block
    (4, 1, 64, [1], None, None),
    (8, 1, 16, [9000], None, None),  # 8 heads' scores past the 65,536 floats a task keeps: in turns of 7 and 1
])
def test_decode_attention_gives_each_head_the_same_bits_however_the_threads_split_its_kv_group(
        heads, kv_heads, head_dim, contexts, softcap, window) -> None:
    # fewer KV heads (times sequences) than threads, or a count that does not share out evenly: a KV head's query
    # heads are split into runs over the threads, each head's sums the ones it takes alone, so every thread count
    # gives the same bits; and each equals the reference within float32 rounding
    gen = torch.Generator().manual_seed(sum(contexts) + head_dim)
    block_size = 16
    num_blocks = max(64, 2 * -(-max(contexts) // block_size))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    width = max(-(-c // block_size) for c in contexts)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in contexts])
    q, lens = torch.randn(len(contexts), heads, head_dim, generator=gen), torch.tensor(contexts)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append(kernels.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, softcap=softcap,
                                                 window=window))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for s, length in enumerate(contexts):
        first = max(0, length - window) if window else 0
        slots = [tables[s, t // block_size].item() * block_size + t % block_size for t in range(first, length)]
        keys = k_cache.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)  # [L, H, D]
        values = v_cache.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", q[s].double(), keys.double()) * 0.125
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), values.double())
        torch.testing.assert_close(outs[0][s].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap, window", [(None, 5), (2.5, None), (1.5, 17), (50.0, 1)])
def test_decode_attention_caps_scores_and_keeps_to_its_window_like_the_masked_reference(softcap, window) -> None:
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, num_blocks, block_size = 8, 2, 32, 24, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    context = torch.tensor([1, 5, 16, 17, 40, 64])  # within, at and past the window, a window starting mid-block
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:4] for _ in range(6)])  # [6, 4]
    q = torch.randn(6, heads, head_dim, generator=gen) * 2
    out = kernels.decode_attention(q, k_cache, v_cache, tables, context, 0.4, softcap=softcap, window=window)
    for s, length in enumerate(context.tolist()):
        first = max(0, length - window) if window else 0
        slots = [tables[s, t // block_size].item() * block_size + t % block_size for t in range(first, length)]
        keys = k_cache.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)  # [L, H, D]
        values = v_cache.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", q[s].double(), keys.double()) * 0.4  # [H, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), values.double())
        # float32 sums in another order and the variants' tanh within 5 ulp: docs/formats.md's 1e-5 for attention
        torch.testing.assert_close(out[s].double(), ref, atol=1e-5, rtol=1e-5)
    uncapped = kernels.decode_attention(q, k_cache, v_cache, tables, context, 0.4)
    assert not torch.equal(out, uncapped)  # the cap or the window changed the scores


def test_decode_attention_names_a_softcap_or_window_out_of_range() -> None:
    q, cache = torch.zeros(1, 2, 8), torch.zeros(2, 4, 1, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    for kwargs, error, name in (({"softcap": 0.0}, ValueError, "softcap"), ({"softcap": float("nan")}, ValueError,
                                "softcap"), ({"softcap": "1"}, TypeError, "softcap"),
                                ({"window": 0}, ValueError, "window"), ({"window": 1.5}, TypeError, "window"),
                                ({"window": True}, TypeError, "window")):
        with pytest.raises(error, match=name):
            kernels.decode_attention(q, cache, cache, tables, lens, 1.0, **kwargs)
    for scale in (float("nan"), float("inf"), -float("inf"), 1e39):  # every output NaN: refused by name
        with pytest.raises(ValueError, match="scale"):
            kernels.decode_attention(q, cache, cache, tables, lens, scale)


def lossless_tiny(kind: str, path) -> None:
    """A tiny model whose projection weights are exactly Q4_1 values (its head: Q8_0), as a GGUF's are."""
    hf = tiny_hf_model(kind)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear):
                fmt = "q8_0" if name == "lm_head" else "q4_1"
                module.weight.copy_(kernels.dequantize(kernels.quantize(module.weight, fmt), fmt))
        if hf.config.tie_word_embeddings:
            emb = hf.get_input_embeddings().weight
            emb.copy_(kernels.dequantize(kernels.quantize(emb, "q8_0"), "q8_0"))
    hf.save_pretrained(path, safe_serialization=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
async def test_the_engine_in_q4_1_serves_float32s_greedy_tokens_on_q4_1_weights(tmp_path, kind) -> None:
    lossless_tiny(kind, tmp_path)
    opts = {"kv_cache_memory": 2**22, "max_model_len": 128, "device": "cpu", "block_size": 16}
    engine = AsyncEngine.from_pretrained(tmp_path, **opts, quantization="q4_1")
    model = engine.core.runner.model
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert isinstance(model.layers[0].attn.qkv_proj, Q4_1Linear) and isinstance(model.output_proj, Q8_0Linear)
    assert len(layers) == 2 * 4 + 1 and all(layer.lossless for layer in layers)
    decode = engine.core.runner.decode
    assert type(decode) is KernelDecode and type(decode.attention) is KernelDecodeSdpaBackend  # attention too
    assert AsyncEngine.plan_memory(tmp_path, **opts, quantization="q4_1") == engine.memory_plan
    reference = load_model(tmp_path, torch.float32, "cpu").model  # plain float32, torch's kernels
    prompts = [[5, 6, 7, 8], list(range(3, 40))]  # the second spans three blocks before decoding
    expected = [PagedRunner(reference, block_size=16).greedy(0, p, 24) for p in prompts]
    assert decode.stack.head is not None  # a decode step is one call
    one_call = decode.stack.decode_packed
    calls = []
    decode.stack.decode_packed = lambda *a: calls.append(1) or one_call(*a)
    async with engine:
        outs = [await engine.generate(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert len(calls) >= 2 * 23  # every decode step of both requests
    # A skipped projection leaves the model on the torch reference forward (decode attention still in the
    # kernel): the same tokens.
    partial = AsyncEngine.from_pretrained(tmp_path, **opts, quantization="q4_1",
                                          quantization_skip=("layers.1.mlp.down_proj",))
    decode = partial.core.runner.decode
    assert type(decode) is TorchDecode and type(decode.attention) is KernelDecodeSdpaBackend
    async with partial:
        outs = [await partial.generate(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
    assert [o.token_ids for o in outs] == expected


def test_block_formats_are_refused_where_the_kernels_cannot_run(tiny_models) -> None:
    """A subprocess without the kernels: q4_1 / q8_0 refused naming the parameter and why, "auto" and the
    suggestions of smaller formats never name them, everything else serves."""
    code = (
        "import torch, sys\n"
        "from asyncinfer import AsyncEngine, InvalidParameterError, kernels\n"
        "from asyncinfer.config import EngineConfig\n"
        "from asyncinfer.models.quant import smaller_cpu_formats\n"
        "assert not kernels.available() and 'ASYNCINFER_DISABLE_KERNELS' in kernels.unavailable_reason()\n"
        "for fmt in ('q4_1', 'q8_0'):\n"
        "    try:\n"
        "        AsyncEngine.from_pretrained(sys.argv[1], device='cpu', kv_cache_memory=2**22, quantization=fmt)\n"
        "    except InvalidParameterError as exc:\n"
        "        assert exc.parameter == 'quantization' and 'cannot run' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('not refused')\n"
        "assert EngineConfig(device='cpu').quantization == 'float16'\n"
        "assert smaller_cpu_formats(None) == ('float16', 'int8')\n"
        "import logging, types\n"
        "from asyncinfer.config import for_model\n"
        "said = []\n"
        "handler = logging.Handler(); handler.emit = lambda record: said.append(record.getMessage())\n"
        "logging.getLogger('asyncinfer').addHandler(handler)\n"
        "gguf = types.SimpleNamespace(native_format='q4_1')  # a Q4_1 file: its own format would be the default\n"
        "assert for_model(EngineConfig(device='cpu'), {}, gguf).quantization == 'float16'\n"
        "assert any('cannot run here' in m and 'using float16' in m for m in said), said\n"
        "AsyncEngine.from_pretrained(sys.argv[1], device='cpu', kv_cache_memory=2**22)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, ASYNCINFER_DISABLE_KERNELS="1")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_models["llama"][0])], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    # Here, where they run: offered, and still never the default.
    assert smaller_cpu_formats(None) == ("float16", "int8", "q8_0", "q4_1")
    assert EngineConfig(device="cpu").quantization == "float16"
    with pytest.raises(InvalidParameterError, match="run on CPU only"):
        check_quantization("q4_1", torch.device("cuda"), torch.float16)


def test_the_fallback_from_a_files_own_block_format_is_logged_once_per_load(tiny_models, monkeypatch,
                                                                            caplog) -> None:
    """A Q4_1 file where the kernels cannot run (as under ASYNCINFER_DISABLE_KERNELS=1): from_pretrained loads it
    as float16 and says so once, not once for the format and again for the memory plan."""
    import dataclasses

    from asyncinfer import loading
    from asyncinfer.kernels import _build

    real = loading.open_checkpoint

    def q4_1_file(path):  # the tiny model's config as a Q4_1 GGUF file's
        checkpoint = real(path)
        return dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, native_format="q4_1"))

    monkeypatch.setattr(loading, "open_checkpoint", q4_1_file)
    for name, value in (("_tried", True), ("_lib", None), ("_reason", "ASYNCINFER_DISABLE_KERNELS is set")):
        monkeypatch.setattr(_build, name, value)  # the state ASYNCINFER_DISABLE_KERNELS=1 leaves
    assert not kernels.available()
    with caplog.at_level("WARNING", logger="asyncinfer"):
        engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], device="cpu", kv_cache_memory=2**22)
    assert engine._version.config.quantization == "float16"
    said = [r.getMessage() for r in caplog.records if "would be the default weight format" in r.getMessage()]
    assert len(said) == 1 and "ASYNCINFER_DISABLE_KERNELS is set" in said[0] and "using float16" in said[0], said


def test_a_projection_that_is_not_whole_blocks_stays_float32() -> None:
    config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=40, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True,
                         attention_bias=False, bos_token_id=None, eos_token_ids=(0,))
    model = LlamaForCausalLM(config)
    apply_weight_format(model, "q4_1")
    mlp = model.layers[0].mlp
    assert type(mlp.down_proj) is torch.nn.Linear  # 40 inputs: not a whole number of 32-weight blocks
    assert isinstance(mlp.gate_up_proj, Q4_1Linear) and isinstance(model.output_proj, Q8_0Linear)


def test_the_kernel_backend_equals_the_torch_reference_forward(tmp_path) -> None:
    """Decode steps of a q4_1 model through KernelDecode (one kernel call a step) and through TorchDecode
    (the model's forward op by op: SDPA, torch's element-wise ops, the same projections): the same logits
    within float32 rounding, the same greedy tokens (the kernel's, from the same call); at batch 2 (int16
    activations) and 6 (float32 panels), q/k/v bias included (qwen2). Prefill steps run the reference."""
    lossless_tiny("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(model, "q4_1")
    cpu = torch.device("cpu")
    kernel, reference = KernelDecode(model, KernelDecodeSdpaBackend(), cpu), TorchDecode(model, SdpaBackend(), cpu)
    stack = kernel.stack
    assert isinstance(stack, kernels.DecodeStack) and len(stack.layers) == len(model.layers)
    head = model.output_proj.kernel_weights()[1]  # the stack holds a view of it: no copy
    assert stack.head is not None and stack.head[1].data_ptr() == head.data_ptr() and stack.head[1].shape == head.shape
    prompts = [list(range(3 + i, 9 + 3 * i)) for i in range(6)]
    fused, plain = PagedRunner(model, seed=1), PagedRunner(model, seed=1)  # the same blocks and stale cache data
    for batch in (2, 6):
        seqs = range(10 * batch, 10 * batch + batch)
        work = list(zip(seqs, prompts[:batch]))
        first = kernel.forward(fused.step_batch(work, last_only=True), fused.kv_caches)
        second = reference.forward(plain.step_batch(work, last_only=True), plain.kv_caches)
        assert first.greedy_ids is None and second.greedy_ids is None  # a prefill: the reference forward
        torch.testing.assert_close(first.logits, second.logits, rtol=0, atol=0)
        last = first.logits.argmax(dim=-1).tolist()
        for _ in range(5):  # decodes: the kernel against op by op
            work = [(s, [t]) for s, t in zip(seqs, last)]
            a, b = kernel.forward(fused.step_batch(work), fused.kv_caches), reference.forward(
                plain.step_batch(work), plain.kv_caches)
            assert type(a) is ModelOutput and b.greedy_ids is None
            # float32 rounding in attention and SwiGLU can move an activation across an int16 step
            # (batch 2): a few parts in 10,000 of a logit at most.
            torch.testing.assert_close(a.logits, b.logits, atol=1e-3, rtol=1e-3)
            assert a.greedy_ids == a.logits.argmax(dim=-1).tolist() == b.logits.argmax(dim=-1).tolist()
            last = a.greedy_ids
    # Profiling: the call adds up its parts (projections, attention, the layers, the head), read through
    # the backend's stack.
    stack.time_parts(True)
    kernel.forward(fused.step_batch([(20, [last[0]])]), fused.kv_caches)
    projections, attention, whole, head = stack.timing.tolist()
    assert 0 < projections and 0 < attention and projections + attention < whole and 0 < head
    stack.time_parts(False)
    assert stack.timing is None


def test_the_stack_and_layer_refuse_inputs_outside_their_tables(tmp_path) -> None:
    lossless_tiny("llama", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(model, "q4_1")
    runner = PagedRunner(model, seed=1)
    runner.step([(1, [3, 4, 5])])
    stack, rotary = KernelDecode(model, KernelDecodeSdpaBackend(), torch.device("cpu")).stack, model.rotary
    caches = runner.kv_caches
    tables = torch.zeros(1, 1, dtype=torch.long)
    one = torch.ones(1, dtype=torch.long)
    vocab = model.embed_tokens.weight.shape[0]
    for ids, positions, match in (([vocab], [1], "token id"), ([-1], [1], "token id"),
                                  ([3], [rotary.cos_cache.shape[0]], "position")):
        with pytest.raises(IndexError, match=match):
            stack(torch.tensor(ids), model.embed_tokens.weight, torch.tensor(positions), rotary.cos_cache,
                  rotary.sin_cache, caches, one, tables, one + 1)
    args = (model.embed_tokens.weight, one, rotary.cos_cache, rotary.sin_cache)
    with pytest.raises(TypeError, match="input_ids must be a CPU int64 tensor"):
        stack(one.int(), *args[:3], args[3], caches, one, tables, one + 1)
    with pytest.raises(ValueError, match="got 1 kv caches for 2 layers"):
        stack(one, *args, caches[:1], one, tables, one + 1)
    # One layer: the wrong width, rope rows or caches are refused by name; a context, slot or block
    # outside the caches too (the kernel reads and writes where they point).
    layer = stack.layers[0]
    hidden, half = model.config.hidden_size, model.config.head_dim // 2
    k, v = caches[0]
    h, cs = torch.zeros(1, hidden), torch.zeros(1, half)
    with pytest.raises(ValueError, match=f"h must be float32 \\[T, {hidden}\\]"):
        layer(torch.zeros(1, hidden + 1), cs, cs, k, v, one, tables, one)
    with pytest.raises(TypeError, match="cos must be a torch.float32 tensor"):
        layer(h, cs.double(), cs, k, v, one, tables, one)
    with pytest.raises(ValueError, match="v_cache must be contiguous float32"):
        layer(h, cs, cs, k, v[:2], one, tables, one)
    slots = k.shape[0] * k.shape[1]
    for s_, t_, c_, match in ((one * slots, tables, one, "outside the caches"),
                              (one, tables + k.shape[0], one, "outside the caches"),
                              (one, tables, one * (k.shape[1] + 1), "beyond its block table")):
        with pytest.raises(IndexError, match=match):
            layer(h, cs, cs, k, v, s_, t_, c_)


def test_bad_inputs_are_refused_by_name() -> None:
    blocks = kernels.pack(random_blocks("q4_1", 8, 2, seed=1), "q4_1")  # 8 x 64
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="contiguous uint8"):
        kernels.gemm(x, blocks, "q4_1", 9)  # the wrong output count for these weights
    with pytest.raises(ValueError, match="x has 40 columns, but the q4_1 weights hold 64 inputs"):
        kernels.gemm(torch.randn(2, 40), blocks, "q4_1", 8)  # not whole blocks
    with pytest.raises(ValueError, match="x has 96 columns, but the q4_1 weights hold 64 inputs"):
        kernels.gemm(torch.randn(2, 96), blocks, "q4_1", 8)  # the activations' mistake, named as such
    with pytest.raises(TypeError, match="pack takes q4_1 blocks as uint8"):
        kernels.pack(torch.zeros(8, 40, dtype=torch.float32), "q4_1")
    with pytest.raises(ValueError, match="dequantize takes q8_0 blocks as uint8"):
        kernels.dequantize(random_blocks("q4_1", 8, 2, seed=1), "q8_0")  # 40 bytes a row: not 34s
    with pytest.raises(ValueError, match="unknown block format 'q3_k'"):
        kernels.unpack(blocks, "q3_k")
    with pytest.raises(TypeError, match=r"weight: quantize takes floating-point weights \[N, K\]"):
        kernels.quantize(torch.randn(64), "q4_1")
    with pytest.raises(ValueError, match="unknown block format"):
        kernels.gemm(x, blocks, "q3_k", 8)
    with pytest.raises(ValueError, match="bias has 3 values"):
        kernels.gemm(x, blocks, "q4_1", 8, torch.zeros(3))
    torch.testing.assert_close(kernels.gemm(x, blocks, "q4_1", 8, torch.ones(8, dtype=torch.float64)),
                               kernels.gemm(x, blocks, "q4_1", 8) + 1)  # a float64 bias is converted
    cache = torch.zeros(4, 16, 1, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.decode_attention(torch.zeros(1, 2, 12), cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                 torch.ones(1, dtype=torch.long), 1.0)
    # The paged inputs are checked before a kernel reads where they point.
    q, tables, one = torch.zeros(1, 2, 16), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    cache = torch.zeros(4, 16, 1, 16)
    for bad_tables, lens, match in ((tables, one * 17, "beyond its block table"), (tables, one * 0, "below 1"),
                                    (tables + 4, one, "outside the caches"), (tables - 1, one, "outside the caches")):
        with pytest.raises(IndexError, match=match):
            kernels.decode_attention(q, cache, cache, bad_tables, lens, 1.0)
    with pytest.raises(TypeError, match="context_lens must be a torch.int64 tensor"):
        kernels.decode_attention(q, cache, cache, tables, one.int(), 1.0)
    with pytest.raises(TypeError, match="rms_norm takes float32"):
        kernels.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    for shape in ((8,), (2, 3, 8)):  # the input's shape back
        x = torch.randn(shape)
        assert kernels.rms_norm(x, torch.ones(8), 1e-5).shape == shape
    # A NaN activation makes its row NaN on every path, as a float matmul does (not silently 0).
    for fmt in ("q4_1", "q8_0"):
        w = kernels.pack(random_blocks(fmt, 8, 2, seed=2), fmt)
        for rows in (2, 6):
            bad = torch.randn(rows, 64)
            bad[0, 3] = float("nan")
            out = kernels.gemm(bad, w, fmt, 8)
            assert out[0].isnan().all() and not out[1:].isnan().any(), (fmt, rows)


@pytest.mark.parametrize("skip", [(), ("layers.1.",)])
async def test_concurrent_requests_mix_decodes_and_prefill_chunks(tmp_path, skip) -> None:
    """Requests arriving while others decode, prompts prefilled in chunks beside two or more decodes (the
    decodes' q is then a view into the step's q/k/v), with every layer fused or one left op by op: each
    request gets float32's own greedy tokens."""
    import asyncio

    lossless_tiny("llama", tmp_path)
    engine = AsyncEngine.from_pretrained(tmp_path, kv_cache_memory=2**22, max_model_len=128, device="cpu",
                                         block_size=16, quantization="q4_1", quantization_skip=skip,
                                         max_num_batched_tokens=24)
    reference = load_model(tmp_path, torch.float32, "cpu").model
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 9, 40, 17, 60, 3))]
    expected = [PagedRunner(reference, block_size=16).greedy(0, p, 16) for p in prompts]

    async def one(i: int) -> list[int]:
        await asyncio.sleep(0.01 * i)  # later ones arrive while the first decode
        out = await engine.generate(prompts[i], SamplingParams(max_tokens=16, ignore_eos=True))
        return out.token_ids

    async with engine:
        got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        stats = engine.core.stats
    assert list(got) == expected
    assert stats.steps > 0


def test_argmax_picks_what_torch_picks() -> None:
    """The greedy sampler's one-pass argmax: the first index among equal maxima, the first NaN, rows of any
    stride, lengths that are not a multiple of 8, all -inf."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 1003, generator=g)
    wide[1, 17] = wide[1, 900] = 50.0  # a tie: the first
    wide[2, :] = float("-inf")
    wide[3, 40] = float("nan")  # NaN beats everything, as in torch
    wide[3, 999] = float("nan")
    wide[4, 1001] = 60.0  # in the tail after the last 8
    for x in (wide, wide[:, :1000], wide[:, :7], wide[:, :1], wide[::2]):
        assert kernels.argmax_takes(x) and kernels.argmax(x) == x.argmax(dim=-1).tolist()
    for x in (wide.double(), wide.t(), wide[0].expand(3, 1003), wide[:, :0], wide[0]):
        assert not kernels.argmax_takes(x)
    with pytest.raises(TypeError, match="float32"):
        kernels.argmax(wide.double())
    with pytest.raises(TypeError, match="contiguous rows"):
        kernels.argmax(wide.t())


def test_the_stack_returns_the_logits_of_its_head(tmp_path) -> None:
    """With the model's block-format head, one call (decode_packed, the engine's path for steps of decodes)
    returns exactly what the stack's normed states times the head give; out-of-range inputs are refused."""
    lossless_tiny("llama", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(model, "q4_1")
    stack = KernelDecode(model, KernelDecodeSdpaBackend(), torch.device("cpu")).stack
    assert stack.head is not None and stack.head[0] == model.output_proj.fmt
    tables_in = (model.embed_tokens.weight, model.rotary.cos_cache, model.rotary.sin_cache)
    runners = [PagedRunner(model, seed=1, backend=KernelDecodeSdpaBackend()) for _ in range(2)]
    for runner in runners:
        runner.step([(1, [3, 4, 5]), (2, [6, 7])])
    last = [8, 9]
    for _ in range(3):
        work = [(1, [last[0]]), (2, [last[1]])]
        ids, pos, meta, _ = runners[0].inputs(work)
        width = meta.decode_block_tables.shape[1]
        packed = (ids.tolist() + pos.tolist() + meta.slot_mapping.tolist() + meta.decode_context_lens.tolist()
                  + meta.decode_block_tables.flatten().tolist())
        one, greedy = stack.decode_packed(packed, 2, width, *tables_in, runners[0].kv_caches)
        assert list(greedy) == one.argmax(dim=-1).tolist()  # the greedy tokens, from the same call
        ids, pos, meta, _ = runners[1].inputs(work)
        with torch.inference_mode():  # the stack's normed states, through the model's head
            two = model.compute_logits(stack(ids, model.embed_tokens.weight, pos, model.rotary.cos_cache,
                                             model.rotary.sin_cache, runners[1].kv_caches, meta.slot_mapping,
                                             meta.decode_block_tables, meta.decode_context_lens))
        assert one.shape == (2, model.config.vocab_size)
        torch.testing.assert_close(one, two, rtol=0, atol=0)
        last = list(greedy)
    caches = runners[0].kv_caches
    slots = caches[0][0].shape[0] * caches[0][0].shape[1]
    good = [1, 6, 0, 6, 2, 3]  # a token at position 6 (slot 0) of a 7-token context in blocks 2, 3
    for bad, match in (([1, 6, slots, 6, 2, 3], "slot or block"), ([1, 6, 0, 7, 2, 64], "slot or block"),
                       ([1, 6, 0, 9, 2, 3], "context length"), ([1, 6, 0, 0, 2, 3], "context length"),
                       ([10**6] + good[1:], "token id"), ([1, -1] + good[2:], "position")):
        with pytest.raises(IndexError, match=match):
            stack.decode_packed(bad, 1, 2, *tables_in, caches)
    with pytest.raises(ValueError, match="holds 5 ints"):
        stack.decode_packed(good[:5], 1, 2, *tables_in, caches)
    with pytest.raises(ValueError, match="at least one token"):
        stack.decode_packed([], 0, 2, *tables_in, caches)
    with pytest.raises(ValueError, match="needs a DecodeStack built with a head"):
        kernels.DecodeStack(stack.layers, model.norm.weight, model.norm.eps)(
            torch.tensor([1]), model.embed_tokens.weight, torch.tensor([1]), model.rotary.cos_cache,
            model.rotary.sin_cache, runners[0].kv_caches, torch.ones(1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), logits=True)


def test_the_stack_checks_what_a_direct_caller_passes(tmp_path) -> None:
    """Direct callers of DecodeStack get typed errors, not reads outside a tensor: caches of another
    shape, tables of another width or dtype, a timing buffer of another dtype; a list of caches that
    now holds other tensors is read again; the runner's and the model's empty steps stay empty."""
    lossless_tiny("llama", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(model, "q4_1")
    runner = PagedRunner(model, seed=1, backend=KernelDecodeSdpaBackend())
    runner.step([(1, [3, 4, 5])])
    stack = KernelDecode(model, runner.backend, torch.device("cpu")).stack
    rotary, embed = model.rotary, model.embed_tokens.weight
    caches = runner.kv_caches
    one, tables = torch.ones(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)

    def call(**kw):
        args = {"input_ids": one, "embed": embed, "positions": one, "cos_table": rotary.cos_cache,
                "sin_table": rotary.sin_cache, "kv_caches": caches, "slots": one, "block_tables": tables,
                "context_lens": one + 1, **kw}
        return stack(**args)

    expected = call()
    k = caches[0][0]
    small = [(torch.zeros(k.shape[0], k.shape[1], 1, 8), torch.zeros(k.shape[0], k.shape[1], 1, 8))] * len(caches)
    with pytest.raises(TypeError, match="contiguous float32 K/V caches"):
        call(kv_caches=small)
    with pytest.raises(TypeError, match="embed must be a CPU table"):
        call(embed=torch.zeros(embed.shape[0], 1))
    with pytest.raises(TypeError, match="cos_table must be contiguous float32"):
        call(cos_table=rotary.cos_cache.double())
    with pytest.raises(TypeError, match="input_ids must be a CPU int64 tensor"):
        call(input_ids=torch.tensor([1, 9, 1])[::2])
    stack.timing = torch.zeros(4)
    with pytest.raises(TypeError, match="timing must be None or contiguous float64"):
        call()
    stack.timing = None
    # Other tensors in the same list: the kernel writes to the new ones (the old pointers are not kept).
    moved = list(caches)
    torch.testing.assert_close(call(kv_caches=moved), expected, rtol=0, atol=0)
    moved[1] = tuple(torch.zeros_like(t) for t in caches[1])
    old_k = caches[1][0].clone()
    call(kv_caches=moved)
    assert moved[1][0].flatten(2)[0, 1].abs().sum() > 0  # block 0, slot 1: this step's K, in the new tensor
    assert torch.equal(caches[1][0], old_k)  # the tensor it replaced is left alone
    with pytest.raises(ValueError, match="at least one token and one block"):
        stack.decode_packed([1], 1, -3, embed, rotary.cos_cache, rotary.sin_cache, caches)
    # Empty steps: nothing to run, an empty result (as before the one-call path).
    empty = runner.backend.build_metadata(query_lens=[], context_lens=[], block_tables=[], slot_mapping=[],
                                          block_size=runner.block_size, device="cpu")
    none = torch.zeros(0, dtype=torch.long)
    assert model(none, none, caches, empty).shape == (0, model.config.hidden_size)


def test_an_empty_step_stays_empty_on_the_one_call_path(tmp_path) -> None:
    lossless_tiny("llama", tmp_path)
    engine = AsyncEngine.from_pretrained(tmp_path, kv_cache_memory=2**22, max_model_len=128, device="cpu",
                                         block_size=16, quantization="q4_1")
    runner = engine.core.runner
    assert type(runner.decode) is KernelDecode
    out = runner.run(runner.prepare([], {}))
    assert type(out) is ModelOutput and out.logits.shape == (0, runner.config.vocab_size)
    assert out.greedy_ids is None
