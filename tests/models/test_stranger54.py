"""``quantization_skip`` holds non-empty layer-name substrings, in the engine's options and in the planner alike."""

from __future__ import annotations

import pytest

from asyncinfer import EngineConfig
from asyncinfer.errors import InvalidParameterError
from asyncinfer.models.config import ModelConfig
from asyncinfer.planner import plan_deployment


@pytest.mark.parametrize("skip", [("",), ("down_proj", " ")])
def test_an_empty_substring_is_refused(skip) -> None:
    """An empty substring is in every layer's name: ``quantization_skip=("",)`` kept every projection in float32
    under q4_k (the ``--quantization-skip`` flag drops empty entries, so the same words meant nothing skipped)."""
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(device="cpu", quantization="q4_k", quantization_skip=skip)
    assert info.value.parameter == "quantization_skip"
    assert str(info.value) == (f"quantization_skip={skip!r} is invalid: allowed a tuple of non-empty layer-name "
                               "substrings, or None")


def _tiny() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=8, num_kv_heads=4, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                       rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False,
                       attention_bias=False, bos_token_id=1, eos_token_ids=(2,))


def test_the_planner_refuses_a_string_as_the_engine_does() -> None:
    """``plan_deployment(quantization_skip="lm_head")`` read the string as its characters ('l', 'm', ...), each a
    substring of most layer names, and planned float32 weights the engine never loads (it refuses the string)."""
    with pytest.raises(InvalidParameterError) as info:
        plan_deployment(_tiny(), quantization="q8_0", quantization_skip="lm_head")
    assert info.value.parameter == "quantization_skip"
    plain = plan_deployment(_tiny(), quantization="q8_0", quantization_skip=("lm_head",))
    assert plain.weight_bytes == plan_deployment(_tiny(), quantization="q8_0", quantization_skip=["lm_head"]).weight_bytes
