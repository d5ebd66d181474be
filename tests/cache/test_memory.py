"""The KV budget: the per-block formula, the plan, the refusal with numbers, planning before loading."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import ConfigurationError, InvalidParameterError
from asyncinfer.cache.kv_tensors import allocate_kv_caches, copy_blocks
from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.memory import MiB, plan_kv_cache, plan_memory
from asyncinfer.models.quant import weight_bytes
from tests.helpers import SMOLLM2  # SmolLM2-135M-Instruct's shapes (the default model)


def test_block_bytes_and_weights_for_smollm2_match_what_is_really_allocated() -> None:
    # The spec's figure against the bytes the engine's own KV tensors take for one block.
    for dtype, expected in ((torch.float32, 737_280), (torch.bfloat16, 368_640)):
        spec = KVCacheSpec.from_model_config(SMOLLM2, block_size=16, dtype=dtype, device=torch.device("cpu"))
        allocated = sum(t.numel() * t.element_size() for kv in allocate_kv_caches(spec, num_blocks=1) for t in kv)
        assert spec.block_bytes == allocated == expected
    # The parameter count against transformers' own Llama of the same shapes (on the meta device).
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        reference = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert weight_bytes(SMOLLM2, 1) == reference == 134_515_008  # one byte a parameter: the parameter count
    assert weight_bytes(SMOLLM2, 4) == 4 * reference


# 2 layers x 2 kv heads x 16 dims, float32, blocks of 4 tokens: 2 KiB per block (K and V).
SMALL = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
                    device=torch.device("cpu"))


def plan(**kw):
    args = {"max_model_len": 64, "weight_bytes": 1000, "kv_cache_memory": None, "kv_cache_fraction": 0.5,
            "activation_reserve": 0, "free_bytes": 10 * MiB}
    return plan_kv_cache(SMALL, **{**args, **kw})


def test_budget_from_bytes_or_fraction() -> None:
    block = 2048  # 2 (K, V) x 2 layers x 2 kv heads x 16 dims x 4 tokens x 4 bytes
    assert SMALL.block_bytes == block
    assert plan(kv_cache_memory=100 * block + 5).num_blocks == 100
    by_fraction = plan(free_bytes=1000 * block, activation_reserve=200 * block, kv_cache_fraction=0.5)
    assert by_fraction.num_blocks == 400  # half of what is left after the reserve
    assert by_fraction.kv_bytes == 400 * block and by_fraction.kv_token_capacity == 1600


def test_refuses_a_cache_that_cannot_hold_one_max_length_request_with_numbers() -> None:
    block = 2048
    with pytest.raises(ConfigurationError) as info:
        plan(kv_cache_memory=15 * block, max_model_len=64)  # 64 tokens need 16 blocks of 4
    message = str(info.value)
    assert "15 blocks" in message and "max_model_len=64" in message and "needs 16 blocks" in message
    assert plan(kv_cache_memory=16 * block, max_model_len=64).num_blocks == 16
    with pytest.raises(ConfigurationError, match="exceeds"):
        plan(kv_cache_memory=20 * MiB)



def test_a_cache_left_no_room_by_the_activation_reserve_names_the_reserve() -> None:
    """100 MiB free for a model of 18 MiB: the 256 MiB activation reserve took all of it, and the error said
    only 'Raise kv_cache_memory / kv_cache_fraction or lower max_model_len' (0 blocks: no length fits)."""
    with pytest.raises(ConfigurationError) as info:
        plan(free_bytes=100 * MiB, activation_reserve=256 * MiB, kv_cache_fraction=None, default_tokens=64)
    assert str(info.value).endswith(
        " Only 0.0 MiB of the 100.0 MiB free after the weights is outside activation_reserve (256.0 MiB): lower "
        "activation_reserve, or give kv_cache_memory.")
    with pytest.raises(ConfigurationError) as info:  # room beside the reserve: the usual advice alone
        plan(free_bytes=10 * MiB, kv_cache_memory=15 * 2048, max_model_len=64)
    assert "activation_reserve" not in str(info.value)


def test_plan_memory_before_loading_from_a_model_config() -> None:
    gib = 1024**3
    p = plan_memory(SMOLLM2, available_bytes=4 * gib, dtype="float32", device="cpu", max_model_len=2048,
                    kv_cache_fraction=0.5, activation_reserve=256 * MiB)
    weights = 538_060_032
    assert p.weight_bytes == weights and p.block_bytes == 737_280 and p.max_model_len == 2048
    # Half of (4 GiB - 538,060,032 bytes of weights - 256 MiB reserve) = 1,744,235,904 bytes: 2365 whole blocks.
    assert p.num_blocks == 2365
    half = plan_memory(SMOLLM2, available_bytes=4 * gib, dtype="bfloat16", device="cpu", kv_cache_memory=256 * MiB)
    assert half.weight_bytes == weights // 2 and half.num_blocks == 256 * MiB // 368_640 == 728
    assert half.max_model_len == 8192  # the model's context length by default
    int8 = plan_memory(SMOLLM2, available_bytes=4 * gib, dtype="float32", device="cpu", max_model_len=2048,
                       kv_cache_fraction=0.5, activation_reserve=256 * MiB, quantization="int8")
    assert int8.weight_bytes == 299_734_272  # int8 linears; down_proj and the tied head float32 (the default skip)
    assert int8.num_blocks == 2527  # half of (4 GiB - 299,734,272 - 256 MiB) = 1,863,398,784 bytes
    with pytest.raises(ConfigurationError, match="max_model_len=8192"):
        plan_memory(SMOLLM2, available_bytes=4 * gib, device="cpu", kv_cache_memory=64 * MiB, dtype="float32")
    with pytest.raises(InvalidParameterError, match="max_model_len"):
        plan_memory(SMOLLM2, device="cpu", max_model_len=10_000)
    with pytest.raises(InvalidParameterError, match="no_such_option"):
        plan_memory(SMOLLM2, device="cpu", no_such_option=1)


def test_copy_blocks_copies_every_layer_from_the_old_contents() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=3, block_size=2, dtype=torch.float32,
                       device=torch.device("cpu"))
    caches = allocate_kv_caches(spec, num_blocks=4)
    assert len(caches) == 2 and all(t.shape == (4, 2, 1, 3) and not t.any() for kv in caches for t in kv)
    for layer, (k, v) in enumerate(caches):
        for b in range(4):
            k[b] = 10 * layer + b
            v[b] = -(10 * layer + b)
    copy_blocks(caches, [(1, 2), (2, 3)])  # 3 gets 2's contents from before the call
    for layer, (k, v) in enumerate(caches):
        assert [k[b, 0, 0, 0].item() for b in range(4)] == [10 * layer + x for x in (0, 1, 1, 2)]
        assert [v[b, 1, 0, 2].item() for b in range(4)] == [-(10 * layer + x) for x in (0, 1, 1, 2)]
    copy_blocks(caches, [])  # nothing to do
