"""ModelConfig: normalisation of transformers configs, validation, derived values."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
from transformers import GPT2Config, LlamaConfig, MistralConfig

from asyncinfer.errors import ModelLoadError
from asyncinfer.models import ModelConfig
from asyncinfer.models.quant import weight_bytes
from tests.helpers import SMOLLM2, tiny_hf_model


def test_llama_fields():
    cfg = ModelConfig.from_hf_config(tiny_hf_model("llama").config)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 2, 4, 2, 16)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    assert not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_qwen2_has_qkv_bias():
    cfg = ModelConfig.from_hf_config(tiny_hf_model("qwen2").config)
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings


def test_llama3_rope_from_rope_parameters():
    cfg = ModelConfig.from_hf_config(tiny_hf_model("llama3_rope").config)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }


def test_transformers4_style_attributes():
    old = SimpleNamespace(
        model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=None, rms_norm_eps=1e-6, max_position_embeddings=64,
        rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 4.0}, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=[3, 4, 3],
    )
    cfg = ModelConfig.from_hf_config(old)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 8
    assert cfg.bos_token_id is None and cfg.eos_token_ids == (3, 4)


def test_mistral_window_applies_within_the_models_context():
    hf = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, sliding_window=1024)
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.max_position_embeddings, cfg.sliding_window, cfg.layer_types) == (8192, 1024, None)
    assert cfg.layer_window(0) == 1024


@pytest.mark.parametrize(
    "hf_config, message",
    [
        (GPT2Config(), "unsupported model_type 'gpt2'"),
        (LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": -4.0}), "yarn rope: factor must be a finite number"),
        (LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": float("inf")}), "yarn rope: beta_fast"),
        (LlamaConfig(hidden_act="gelu"), "hidden_act"),
        (LlamaConfig(attention_bias=True), "attention_bias"),
        (LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial"),
        (LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "unsupported rope type 'dynamic'"),
    ],
)
def test_unsupported_configs_raise(hf_config, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_config(hf_config)


def test_validation():
    cfg = ModelConfig.from_hf_config(tiny_hf_model("llama").config)
    with pytest.raises(ModelLoadError, match="multiple of num_kv_heads"):
        dataclasses.replace(cfg, num_kv_heads=3)
    with pytest.raises(ModelLoadError, match="outside vocab"):
        dataclasses.replace(cfg, eos_token_ids=(999,))
    with pytest.raises(ModelLoadError, match="needs low_freq_factor"):
        dataclasses.replace(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0})


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_weight_bytes_count_transformers_parameters(kind):
    hf = tiny_hf_model(kind)
    cfg = ModelConfig.from_hf_config(hf.config)
    assert weight_bytes(cfg, 1) == sum(p.numel() for p in hf.parameters())  # as many parameters as transformers'
    assert weight_bytes(cfg, 2) == 2 * sum(p.numel() for p in hf.parameters())


def test_derived_sizes_of_smollm2():
    """SmolLM2-135M's config.json fields; the sizes derived from them, written out by hand."""
    hf = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.q_size, cfg.kv_size) == (576, 192)  # 9 x 64 query rows, 3 x 64 key (and value) rows
    assert cfg == SMOLLM2  # the config the size tests use (tests.helpers) is this one


def test_yarn_reads_as_transformers_does():
    """The config's own original_max_position_embeddings wins over rope_scaling's; a missing one is the model's
    context (transformers fills it in); the attention factor comes from factor unless given."""
    from asyncinfer.models.layers import rope_attention_factor

    cfg = ModelConfig.from_hf_config(LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0},
                                                 max_position_embeddings=4096))
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    assert rope_attention_factor(cfg) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    given = ModelConfig.from_hf_config(LlamaConfig(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 0.5}))
    assert given.rope_scaling["original_max_position_embeddings"] == 1024 and rope_attention_factor(given) == 0.5
