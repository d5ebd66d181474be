"""The engine on CUDA (run by scripts/gpu_check.sh on a machine with a GPU; skipped elsewhere)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.models.attention import register_attention_backend
from asyncinfer.models.attention.sdpa import SdpaBackend
from asyncinfer.models.attention.triton_backend import TritonDecodeBackend
from tests.helpers import greedy, hf_logits

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


async def test_cuda_fp32_tokens_equal_cpu(tiny_models) -> None:
    """The CPU (SDPA), CUDA's default (SDPA) and CUDA with the Triton paged-decode backend registered as its
    default: the same greedy tokens."""
    path, _ = tiny_models["llama"]
    prompts = [[5 + i, 9, 17 + 2 * i, 33] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = {}
    runs = [("cpu", SdpaBackend), ("cuda", SdpaBackend), ("cuda", TritonDecodeBackend)]
    try:
        for device, backend in runs:
            if backend is TritonDecodeBackend:
                register_attention_backend(TritonDecodeBackend, default_for=("cuda",))
            engine = AsyncEngine.from_pretrained(path, device=device, dtype="float32",
                                                 kv_cache_memory=8 * 2**20, max_model_len=256)
            assert type(engine.core.runner.decode.attention) is backend
            async with engine:
                outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            results[(device, backend.name)] = [o.token_ids for o in outs]
            assert engine.kv_stats().used_blocks == 0
    finally:  # CUDA's default back to SDPA for the other tests of this process
        register_attention_backend(SdpaBackend, default_for=("cuda",))
    assert results[("cuda", "sdpa")] == results[("cpu", "sdpa")]
    assert results[("cuda", "triton")] == results[("cpu", "sdpa")]


async def test_cuda_default_dtype_is_half_precision_and_serves(tiny_models) -> None:
    path, hf = tiny_models["qwen2"]
    engine = AsyncEngine.from_pretrained(path, device="cuda", kv_cache_fraction=0.01, max_model_len=256)
    assert engine.config.dtype in (torch.bfloat16, torch.float16)
    prompts = [[3, 4, 5 + i] for i in range(8)]
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy(8)) for p in prompts))
    # Half precision need not pick float32's token where two are nearly tied (some of these prompts'
    # top two logits are 0.01 apart), but each token it picks is one float32 ranks best within 0.15
    # given the same prefix (teacher-forced); the best is about 2 above the median token.
    for p, out in zip(prompts, outs):
        assert len(out.token_ids) == 8
        logits = hf_logits(hf, p + out.token_ids)[len(p) - 1 : len(p) + 7]  # the rows that chose them
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (logits.max(dim=1).values - chosen).max() < 0.15, (p, out.token_ids)


async def test_cuda_embeddings_equal_cpu(minilm_dir) -> None:
    texts = ["The cat sat on the mat.", "A much longer sentence about the weather in the mountains today.", "x"]
    vectors = {}
    for device in ("cpu", "cuda"):
        async with AsyncEngine.from_pretrained(minilm_dir, device=device, dtype="float32") as engine:
            vectors[device] = torch.cat(await asyncio.gather(*(engine.embed(t) for t in texts)))
    cosine = torch.nn.functional.cosine_similarity(vectors["cuda"], vectors["cpu"], dim=-1)
    assert cosine.min().item() >= 1 - 1e-5
    async with AsyncEngine.from_pretrained(minilm_dir, device="cuda") as engine:  # bf16/fp16 by default
        half = await engine.embed(texts)
    assert torch.nn.functional.cosine_similarity(half, vectors["cpu"], dim=-1).min().item() >= 0.99


async def test_cuda_float16_format_sets_the_dtype_and_serves(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, device="cuda", quantization="float16", kv_cache_memory=8 * 2**20,
                                         max_model_len=256)
    assert engine.config.dtype == torch.float16
    async with engine:
        out = await engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
        report = engine.memory_report()
    assert len(out.token_ids) == 8
    assert report.allocated_bytes is not None and report.allocated_bytes >= report.models[0].weight_bytes


async def test_cuda_swaps_free_the_old_version(tiny_models) -> None:
    """Two more swaps after a first one, torch's CUDA allocator holds what it held before them: the
    old versions' weights and KV pools went back (nothing pinned them). The first swap is not
    counted: its load runs on a new worker thread, whose cuBLAS handle takes a workspace once
    (32 MiB on an H200), which torch keeps for the thread's life."""
    path, _ = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, device="cuda", dtype="float32", kv_cache_memory=8 * 2**20,
                                         max_model_len=256)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    async with engine:
        first = await engine.generate([5, 6, 7], params)
        await engine.swap_model(path)
        assert (await engine.generate([5, 6, 7], params)).token_ids == first.token_ids
        while len(engine.model_info()) > 1 or engine.num_unfinished_requests:
            await asyncio.sleep(0.01)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(2):
            await engine.swap_model(path)
            again = await engine.generate([5, 6, 7], params)
            assert again.token_ids == first.token_ids
        while len(engine.model_info()) > 1 or engine.num_unfinished_requests:
            await asyncio.sleep(0.01)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
    assert after <= before


@pytest.mark.real_model
async def test_cuda_real_model_picks_the_reference_tokens(real_gguf, real_hf_reference) -> None:
    """SmolLM2 on the GPU in float32: every greedy token is one transformers' float32 CPU model ranks
    best (within float noise) given the same prefix, for a batch of prompts served together."""
    hf, tok = real_hf_reference
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    engine = AsyncEngine.from_pretrained(real_gguf, device="cuda", dtype="float32", kv_cache_memory=64 * 2**20,
                                         max_model_len=512)
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy(16)) for p in prompts))
    for p, out in zip(prompts, outs):
        assert len(out.token_ids) == 16
        logits = hf_logits(hf, p + out.token_ids)[len(p) - 1 : len(p) + 15]
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (logits.max(dim=1).values - chosen).max() < 1e-2, (p, out.token_ids)


async def test_cuda_compiled_decoder_serves_the_eager_tokens(tiny_models) -> None:
    """torch_compile=True on CUDA (Triton kernels for the element-wise chains): float32 tokens equal eager's."""
    path, _ = tiny_models["llama"]
    prompts = [[5 + i, 9, 17 + 2 * i, 33] * (i + 1) for i in range(6)]
    results = {}
    for compiled in (False, True):
        engine = AsyncEngine.from_pretrained(path, device="cuda", dtype="float32", kv_cache_memory=8 * 2**20,
                                             max_model_len=256, torch_compile=compiled)
        assert (engine.model_info()[0].compile_seconds is not None) == compiled
        async with engine:
            outs = await asyncio.gather(*(engine.generate(p, greedy(16)) for p in prompts))
        results[compiled] = [o.token_ids for o in outs]
    assert results[True] == results[False]
