"""The default KV budget is sized from the workload, and its memory is committed lazily."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import InvalidParameterError
from asyncinfer.cache.kv_tensors import allocate_kv_caches
from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.memory import DEFAULT_KV_FULL_REQUESTS, GiB, MiB, plan_memory

from .test_memory import SMOLLM2

BLOCK = 737_280  # SmolLM2-135M, float32, 16 tokens


def test_cpu_default_holds_a_few_full_length_requests_not_a_quarter_of_the_ram() -> None:
    plan = plan_memory(SMOLLM2, available_bytes=64 * GiB, device="cpu", dtype="float32")
    assert plan.max_model_len == 8192
    assert plan.kv_token_capacity == DEFAULT_KV_FULL_REQUESTS * 8192 == 32768
    assert plan.kv_bytes == 2048 * BLOCK  # 1.4 GiB, where 25 % of the free memory would be 15.9 GiB
    few = plan_memory(SMOLLM2, available_bytes=64 * GiB, device="cpu", max_num_seqs=2, max_model_len=1024)
    assert few.kv_token_capacity == 2 * 1024  # max_num_seqs below the default count
    # Never more than a quarter of what is free after the weights and the reserve.
    tight = plan_memory(SMOLLM2, available_bytes=1 * GiB, device="cpu", dtype="float32", max_model_len=1024)
    assert tight.num_blocks == int((1 * GiB - tight.weight_bytes - 256 * MiB) * 0.25) // BLOCK == 90


def test_explicit_budgets_are_kept() -> None:
    by_fraction = plan_memory(SMOLLM2, available_bytes=8 * GiB, device="cpu", kv_cache_fraction=0.5)
    assert by_fraction.num_blocks == int((8 * GiB - by_fraction.weight_bytes - 256 * MiB) * 0.5) // BLOCK
    assert plan_memory(SMOLLM2, available_bytes=8 * GiB, device="cpu", kv_cache_memory=600 * BLOCK).num_blocks == 600
    with pytest.raises(InvalidParameterError) as err:
        plan_memory(SMOLLM2, device="cpu", kv_cache_fraction=0.0)
    assert err.value.parameter == "kv_cache_fraction"


def test_kv_memory_is_committed_only_when_written() -> None:
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    spec = KVCacheSpec.from_model_config(SMOLLM2, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    before = rss()
    caches = allocate_kv_caches(spec, num_blocks=1024)  # 720 MiB of zeros
    assert rss() - before < 64 * MiB
    k, v = caches[0]
    assert k.shape == (1024, 16, 3, 64) and k.dtype == torch.float32 and not k.any() and not v.any()
    k[:512] = 1.0  # writing half of one layer's K (6 MiB) commits it
    assert rss() - before > 0.8 * k[:512].nbytes
    assert torch.equal(k[512:], torch.zeros_like(k[512:]))
    bf16 = allocate_kv_caches(
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.bfloat16,
                    device=torch.device("cpu")), num_blocks=3)
    assert bf16[0][0].dtype == torch.bfloat16 and not bf16[0][0].any()
    # Its own mappings (whatever the process freed before: memory glibc keeps would have to be cleared, and
    # committed, at once): the pages written go back to the system with the tensors.
    for layer_k, _ in caches:
        layer_k.fill_(1.0)  # every layer's K: 360 MiB committed
    written = rss()
    assert written - before > 0.9 * 360 * MiB
    del caches, k, v, layer_k
    assert written - rss() > 0.9 * 360 * MiB
