"""The engine on CUDA (run by scripts/gpu_check.sh on a machine with a GPU; skipped elsewhere)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncinfer import AsyncEngine, SamplingParams
from tests.helpers import greedy, hf_logits

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


async def test_cuda_fp32_tokens_equal_cpu(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    prompts = [[5 + i, 9, 17 + 2 * i, 33] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = {}
    for device in ("cpu", "cuda"):
        engine = AsyncEngine.from_pretrained(path, device=device, dtype="float32",
                                             kv_cache_memory=8 * 2**20, max_model_len=256)
        async with engine:
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        results[device] = [o.token_ids for o in outs]
        assert engine.kv_stats().used_blocks == 0
    assert results["cuda"] == results["cpu"]


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
