"""The model-family registry: the one list of architectures, and a new family added in one place."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncinfer.errors import InvalidParameterError, ModelLoadError
from asyncinfer.models import (
    LlamaForCausalLM,
    ModelConfig,
    load_model,
    model_family,
    register_model_family,
    registry,
)
from asyncinfer.models.gemma import Gemma3ForCausalLM, GemmaForCausalLM
from asyncinfer.models.llama import LLAMA_WEIGHT_MAP
from asyncinfer.models.registry import ModelFamily, supported_architectures
from tests.helpers import PagedRunner, hf_logits, tiny_hf_model


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Families registered by a test stay in that test."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_NAMES", dict(registry._NAMES))


def test_the_built_in_families() -> None:
    assert supported_architectures() == ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3")
    assert supported_architectures(gguf=True) == ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
    for name, hf_name in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                          ("mistral", "MistralForCausalLM")):
        family = model_family(name)
        assert model_family(hf_name) is family and family.name == name
        assert family.model_class is LlamaForCausalLM and family.weight_map is LLAMA_WEIGHT_MAP
    assert model_family("qwen2").qkv_bias and not model_family("llama").qkv_bias
    assert model_family("mistral").sliding_window and model_family("llama").gguf_permuted_qk
    for name, hf_names, cls in (("gemma2", ("Gemma2ForCausalLM",), GemmaForCausalLM),
                                ("gemma3", ("Gemma3ForCausalLM", "gemma3_text"), Gemma3ForCausalLM)):
        family = model_family(name)
        assert all(model_family(n) is family for n in hf_names) and family.model_class is cls and family.gguf
        assert (family.hidden_act, family.norm_weight_offset, family.gguf_eot_tokens) == (
            "gelu_pytorch_tanh", 1.0, ("<end_of_turn>",))


def test_unknown_names_are_refused_with_the_list() -> None:
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2'; supported: llama, qwen2, mistral, "
                                              r"qwen3, phi3, gemma2, gemma3$"):
        model_family("gpt2")
    with pytest.raises(ModelLoadError,
                       match=r"unsupported GGUF architecture 'mistral'; supported: llama, qwen2, qwen3, phi3, gemma2, "
                             r"gemma3$"):
        model_family("mistral", what="GGUF architecture", gguf=True)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'falcon'"):
        dataclasses.replace(ModelConfig.from_hf_config(SimpleNamespace(**HF_FIELDS)), architecture="falcon")


HF_FIELDS = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 64}


def test_a_hf_config_names_its_family_by_class_first() -> None:
    by_class = SimpleNamespace(**{**HF_FIELDS, "model_type": "my-finetune", "architectures": ["Qwen2ForCausalLM"]})
    cfg = ModelConfig.from_hf_config(by_class)
    assert cfg.architecture == "qwen2" and cfg.attention_bias  # the family's quirk applies
    assert ModelConfig.from_hf_config(SimpleNamespace(**HF_FIELDS)).architecture == "llama"


def test_a_name_cannot_be_taken_twice(clean_registry) -> None:
    clash = ModelFamily("llama-copy", LlamaForCausalLM, LLAMA_WEIGHT_MAP, ("LlamaForCausalLM",))
    with pytest.raises(InvalidParameterError, match="LlamaForCausalLM"):
        register_model_family(clash)
    assert model_family("LlamaForCausalLM").name == "llama"


class RenamedLlama(LlamaForCausalLM):
    """A new family: Llama's network, but checkpoints that say "decoder." where Llama's say "model."."""


RENAMED_MAP = tuple((hf.replace("model.", "decoder.", 1), gg, param, shard) for hf, gg, param, shard in LLAMA_WEIGHT_MAP)


def test_a_new_family_is_one_registration(clean_registry, tmp_path):
    """Register a family (class + weight map) and a checkpoint naming it loads with its map and class."""
    register_model_family(ModelFamily("renamed-llama", RenamedLlama, RENAMED_MAP, ("RenamedLlamaForCausalLM",)))
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    file = tmp_path / "model.safetensors"
    save_file({k.replace("model.", "decoder.", 1): v for k, v in load_file(file).items()}, file,
              metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["RenamedLlamaForCausalLM"]}))

    loaded = load_model(tmp_path, torch.float32, "cpu")
    assert type(loaded.model) is RenamedLlama and loaded.config.architecture == "renamed-llama"
    tokens = list(range(5, 30))
    (ours,) = PagedRunner(loaded.model).step([(0, tokens)])
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=1e-4, rtol=0)
    assert "renamed-llama" not in supported_architectures(gguf=True)  # no GGUF unless it says so


def test_a_gguf_of_an_unregistered_architecture_is_refused(tmp_path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError,
                       match=r"unsupported GGUF architecture 'falcon'; supported: llama, qwen2, qwen3, phi3, gemma2, "
                             r"gemma3$"):
        load_model(path, torch.float32, "cpu")


def test_the_supported_list_does_not_depend_on_import_order() -> None:
    """``asyncinfer info`` of a gpt_neox directory listed ``llama, qwen2, mistral, gemma2, gemma3, qwen3, phi3``
    (the CLI had imported the Gemma module first), not the order the docs and ``asyncinfer plan`` give."""
    import subprocess
    import sys

    code = ("import asyncinfer.models.gemma\n"
            "from asyncinfer.models.registry import supported_architectures as s\n"
            "print(s()); print(s(gguf=True))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.splitlines() == [str(("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3")),
                                        str(("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"))]
