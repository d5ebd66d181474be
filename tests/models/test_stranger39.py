"""A stranger's first hour (stranger39): Hugging Face directories of one's own, a config with a rope type
asyncinfer does not implement.

docs/models_and_embeddings.md: "Any other type is refused at load with a ``ModelLoadError`` naming it". The
refusal listed what is supported as ``default, linear, llama3, yarn, longrope, freq_factors``: ``freq_factors``
is the GGUF reader's own name for a file's ``rope_freqs`` tensor, not a rope type of transformers. A user who
took the list at its word and wrote ``"rope_type": "freq_factors"`` into config.json got a model that
asyncinfer loaded and ran (transformers cannot: ``KeyError: 'freq_factors'``). A config.json's refusal lists the
types a config may name now, and ``freq_factors`` there is refused like any other unknown type.

And a download whose vocabulary is ``tokenizer.model`` alone was refused with transformers' "`tiktoken` is
required to read a `tiktoken` file": the package it needs is sentencepiece, which the refusal names now.

And a directory without an index read every ``*.safetensors`` file in it, a later file's tensor silently replacing
an earlier one's of the same name: ``model.safetensors`` beside an older copy or another run's weights generated
with whichever sorted last, and beside a PEFT ``adapter_model.safetensors`` was refused for its LoRA tensors.
transformers reads ``model.safetensors`` alone there; so does asyncinfer now, and a tensor that two weight files
hold is refused naming both.

And a Hub id typed in another case than the local cache holds it (``me/Tiny`` for ``me/tiny``) was told to download
the model again; the cached spelling is named now.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncinfer import AsyncEngine, ModelLoadError, SamplingParams, cli
from asyncinfer.memory import read_model_config
from asyncinfer.model_source import resolve_model
from tests.helpers import tiny_hf_config, tiny_hf_model

OPTIONS = {"device": "cpu", "num_threads": 1}


def _model_dir(tmp_path: Path, rope_scaling: dict) -> Path:
    """A config.json naming ``rope_scaling`` and weights no reader can parse: every refusal comes first."""
    tiny_hf_config("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": rope_scaling}))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    return tmp_path


def test_an_unknown_rope_type_lists_only_the_types_a_config_may_name(tmp_path, capsys) -> None:
    model = _model_dir(tmp_path, {"rope_type": "longrope_v9", "factor": 2.0})
    with pytest.raises(ModelLoadError) as refused:
        AsyncEngine.from_pretrained(model, **OPTIONS)
    assert "unsupported rope type 'longrope_v9'; supported: default, linear, llama3, yarn, longrope" in str(refused.value)
    assert "freq_factors" not in str(refused.value)
    with pytest.raises(ModelLoadError, match="unsupported rope type 'longrope_v9'") as planned:
        read_model_config(model)
    assert "freq_factors" not in str(planned.value)
    assert cli.main(["info", str(model)]) != 0
    assert "freq_factors" not in capsys.readouterr().err


def test_the_gguf_readers_own_rope_type_in_a_config_json_is_refused(tmp_path) -> None:
    """transformers has no ``freq_factors`` rope type (its model fails to build): asyncinfer refuses it too,
    before any weight is read, rather than running what no reference runs."""
    model = _model_dir(tmp_path, {"rope_type": "freq_factors", "factors": [1.0] * 8})
    with pytest.raises(ModelLoadError, match="unsupported rope type 'freq_factors'; supported: default, linear"):
        AsyncEngine.from_pretrained(model, **OPTIONS)
    with pytest.raises(ModelLoadError, match="unsupported rope type 'freq_factors'"):
        read_model_config(model)


def test_a_sentencepiece_only_tokenizer_without_the_package_names_the_package(tmp_path, monkeypatch) -> None:
    """A download whose vocabulary is ``tokenizer.model`` alone (no ``tokenizer.json``: older Llama / Mistral
    uploads): transformers needs the sentencepiece package (not a dependency) to read it, falls back to reading
    it as a tiktoken file, and said only "`tiktoken` is required to read a `tiktoken` file", which sent the user
    to install the wrong package. The refusal names the file, the package and the other way out."""
    from asyncinfer.models import checkpoint

    monkeypatch.setattr(checkpoint, "_has_sentencepiece", lambda: False, raising=False)
    tiny_hf_config("llama").save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (tmp_path / "tokenizer.model").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError) as refused:
        checkpoint.load_hf_tokenizer(tmp_path)
    said = str(refused.value)
    assert "its vocabulary is tokenizer.model (SentencePiece's) without a tokenizer.json" in said
    assert "pip install sentencepiece" in said and "copy the model's tokenizer.json" in said


def _greedy(model: Path) -> list[int]:
    async def run() -> list[int]:
        async with await AsyncEngine.load(model, quantization=None, **OPTIONS) as engine:
            out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))
            return list(out.token_ids)

    return asyncio.run(run())


def _save(model, file: Path) -> None:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(file), metadata={"format": "pt"})


def test_model_safetensors_is_the_model_beside_other_weight_files(tmp_path) -> None:
    clean, cluttered = tmp_path / "clean", tmp_path / "cluttered"
    tiny_hf_model("llama").save_pretrained(clean)
    expected = _greedy(clean)
    shutil.copytree(clean, cluttered)
    _save(tiny_hf_model("llama", seed=5), cluttered / "z-older-run.safetensors")  # same names, other weights
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)},
              str(cluttered / "adapter_model.safetensors"), metadata={"format": "pt"})
    assert _greedy(cluttered) == expected


def test_a_tensor_in_two_weight_files_is_refused_naming_both(tmp_path) -> None:
    tiny_hf_config("llama").save_pretrained(tmp_path)
    _save(tiny_hf_model("llama"), tmp_path / "a.safetensors")
    _save(tiny_hf_model("llama", seed=5), tmp_path / "b.safetensors")
    with pytest.raises(ModelLoadError, match=r"tensor '[^']+' is in two weight files, a.safetensors and b.safetensors"):
        AsyncEngine.from_pretrained(tmp_path, **OPTIONS)


def test_a_hub_id_cached_in_another_case_is_pointed_at(tmp_path, monkeypatch, capsys) -> None:
    """``asyncinfer chat --model me/Tiny`` with ``me/tiny`` in the local Hugging Face cache (the Hub reads ids in any
    case; its cache keeps the spelling a model was fetched under) was told to fetch it with ``huggingface-cli
    download me/Tiny``: a second download of a model already there. The cached spelling is named now."""
    snapshot = tmp_path / "hub" / "models--me--tiny" / "snapshots" / "abc123"
    tiny_hf_config("llama").save_pretrained(snapshot)
    (tmp_path / "hub" / "models--me--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--me--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    for typed in ("me/Tiny", "ME/TINY"):
        with pytest.raises(ModelLoadError, match=f"model '{typed}' is not in the local Hugging Face cache .*, "
                                                 "but 'me/tiny' is: .*did you mean 'me/tiny'\\?") as refused:
            resolve_model(typed)
        assert "huggingface-cli download" not in str(refused.value)
    assert cli.main(["info", "me/TINY"]) != 0
    assert "did you mean 'me/tiny'?" in capsys.readouterr().err
    assert resolve_model("me/tiny") == snapshot
    with pytest.raises(ModelLoadError, match="fetch it once with `huggingface-cli download me/other`"):
        resolve_model("me/other")
