"""A thirteenth stranger's first hour with a model of their own: what misled, each held to its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncinfer.errors import ModelLoadError
from asyncinfer.models.loader import read_model_config
from tests.helpers import tiny_hf_config


def _config_dir(tmp_path: Path, **changes: object) -> Path:
    raw = {**tiny_hf_config("qwen3").to_dict(), **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_a_model_type_transformers_does_not_know_is_an_unsupported_model_type(tmp_path: Path) -> None:
    """A config.json whose ``architectures`` name a family that runs (Qwen3ForCausalLM) but whose ``model_type`` is
    mistyped ("qwen9") was refused with transformers' "update Transformers with pip install --upgrade
    transformers", advice that cannot make it load: it is an unsupported model_type, named with what runs."""
    path = _config_dir(tmp_path, model_type="qwen9", architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ModelLoadError) as refused:
        read_model_config(path)
    assert str(refused.value) == (
        "unsupported model_type 'qwen9' (architectures: Qwen3ForCausalLM): transformers has no config for it; "
        "supported: llama, qwen2, mistral, qwen3, phi3, gemma2, gemma3 (config.json's model_type names one)")
    assert "upgrade" not in str(refused.value)


def test_a_known_model_type_still_reads(tmp_path: Path) -> None:
    assert read_model_config(_config_dir(tmp_path, architectures=["Qwen3ForCausalLM"])).architecture == "qwen3"


def test_tokenizer_files_without_a_vocabulary_say_what_is_missing_in_one_line(tmp_path: Path) -> None:
    """A directory whose tokenizer.json was left behind (tokenizer_config.json copied alone) was refused with
    transformers' five lines about slow tokenizers and sentencepiece: the file missing is the vocabulary."""
    from asyncinfer.models.checkpoint import load_hf_tokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ModelLoadError) as refused:
        load_hf_tokenizer(tmp_path)
    said = str(refused.value)
    assert "\n" not in said
    assert said == (  # (transformers' own words, which advised installing sentencepiece or tiktoken, left out)
        f"cannot load the tokenizer in {tmp_path}: it holds tokenizer_config.json but no vocabulary (tokenizer.json, "
        "tokenizer.model, vocab.json): copy the model's tokenizer files beside its config.json")


def test_a_directory_of_several_gguf_files_names_them(tmp_path: Path) -> None:
    """``asyncinfer info models/`` with two quantisations side by side said "no config.json and several .gguf
    files", leaving the user to list the directory for the path to give."""
    for name in ("b.Q8_0.gguf", "a.Q4_K_M.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as refused:
        read_model_config(tmp_path)
    assert str(refused.value) == (f"{tmp_path} is not a model directory: no config.json and 2 .gguf files; give one "
                                  f"of them: {tmp_path / 'a.Q4_K_M.gguf'}, {tmp_path / 'b.Q8_0.gguf'}")
