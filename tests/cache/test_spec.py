"""KVCacheSpec: the one definition of the KV layout, read by the planner, the tensors and the runner."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncinfer import InvalidParameterError
from asyncinfer.cache.kv_tensors import allocate_kv_caches
from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.models import ModelConfig

CPU = torch.device("cpu")

# A GQA decoder: 4 layers, 8 query heads sharing 2 KV heads of 32 dims.
CONFIG = ModelConfig(
    architecture="llama", vocab_size=100, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=128, tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
    eos_token_ids=(),
)


def test_built_from_a_model_config_with_derived_sizes() -> None:
    spec = KVCacheSpec.from_model_config(CONFIG, block_size=8, dtype=torch.float16, device=CPU)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size) == (4, 2, 32, 8)
    assert spec.dtype_bytes == 2
    assert spec.bytes_per_token == 1024  # K and V, 4 layers, 2 heads, 32 dims, 2 bytes
    assert spec.block_bytes == 8192
    assert spec.layer_shape(5) == (5, 8, 2, 32)


def test_the_allocated_tensors_take_exactly_the_planned_bytes() -> None:
    spec = KVCacheSpec.from_model_config(CONFIG, block_size=8, dtype=torch.bfloat16, device=CPU)
    caches = allocate_kv_caches(spec, num_blocks=3)
    assert len(caches) == 4
    assert {(t.shape, t.dtype, t.device) for kv in caches for t in kv} == {((3, 8, 2, 32), torch.bfloat16, CPU)}
    assert sum(t.numel() * t.element_size() for kv in caches for t in kv) == 3 * spec.block_bytes == 24_576


def test_frozen() -> None:
    spec = KVCacheSpec.from_model_config(CONFIG, block_size=8, dtype=torch.float32, device=CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 16  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value",
    [("block_size", 0), ("block_size", True), ("num_layers", 2.0), ("head_dim", -1),
     ("dtype", torch.int8), ("dtype", "float32"), ("device", "cpu")],
)
def test_bad_fields_name_the_parameter(field: str, value: object) -> None:
    good = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "block_size": 4, "dtype": torch.float32, "device": CPU}
    with pytest.raises(InvalidParameterError, match=field):
        KVCacheSpec(**{**good, field: value})
