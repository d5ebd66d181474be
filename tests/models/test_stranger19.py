"""A user's own GGUF file whose tokenizer cannot read text is named at load (stranger19).

transformers builds a GGUF file's tokenizer by its architecture: a ``qwen2`` file holding a SentencePiece
vocabulary (``benchmarks/make_gguf.py --arch qwen2`` writes one) gets a byte-level BPE that matches none of its
tokens, so every text prompt reached the model as ``<s>`` alone, silently.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from asyncinfer import AsyncEngine
from benchmarks.make_gguf import SHAPES, write

TINY = dict(SHAPES["tiny"], hidden=128, intermediate=256, heads=4, kv_heads=2, vocab_size=320)


def _load(path: Path) -> AsyncEngine:
    return AsyncEngine.from_pretrained(path, kv_cache_memory=1 << 20, max_model_len=64, num_threads=1)


def test_a_tokenizer_that_drops_text_is_named_at_load(tmp_path, caplog) -> None:
    path = tmp_path / "qwen2_spm.gguf"
    write(path, TINY, "qwen2", "q8_0", "q8_0", "spm", 0)
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        engine = _load(path)
    tokenizer = engine.get_tokenizer()
    assert tokenizer.encode("hello world", add_special_tokens=False) == []  # what the warning is about
    warnings = [r.getMessage() for r in caplog.records if "encodes the text 'hello world' to no token" in r.getMessage()]
    assert len(warnings) == 1
    assert f"gguf:{path}" in warnings[0] and "send token ids" in warnings[0]


def test_a_tokenizer_that_reads_text_loads_without_the_warning(tmp_path, caplog) -> None:
    path = tmp_path / "llama_spm.gguf"
    write(path, TINY, "llama", "q8_0", "q8_0", "spm", 0)
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        engine = _load(path)
    assert len(engine.get_tokenizer().encode("hello world", add_special_tokens=False)) == 16  # its byte tokens
    assert "to no token" not in caplog.text


def test_a_truncated_safetensors_shard_names_the_tensor_cut_short(tmp_path) -> None:
    """safetensors itself says only "incomplete metadata, file not fully covered"; the refusal now says which
    tensor runs past the end and where, as a truncated GGUF file's does."""
    from safetensors.torch import save_file

    from asyncinfer.errors import ModelLoadError
    from asyncinfer.models.checkpoint import iter_safetensors, tensor_names

    file = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.zeros(16, 16), "b.weight": torch.ones(16, 16)}, str(file))
    whole = file.read_bytes()
    header = 8 + int.from_bytes(whole[:8], "little")
    file.write_bytes(whole[:header + 1024 + 100])  # a.weight whole (1024 bytes), b.weight cut after 100
    expected = (f"tensor 'b.weight' runs past the end of the file (1024 bytes at {header + 1024}, the file has "
                f"{header + 1124}): a truncated file")
    with pytest.raises(ModelLoadError) as names:
        list(tensor_names([file]))
    with pytest.raises(ModelLoadError) as tensors:
        list(iter_safetensors([file]))
    for caught in (names, tensors):
        assert str(caught.value) == f"cannot read weights from {file}: {expected} (an interrupted copy or download?)"


def test_a_safetensors_file_without_a_readable_header_keeps_the_librarys_words(tmp_path) -> None:
    from asyncinfer.errors import ModelLoadError
    from asyncinfer.models.checkpoint import tensor_names

    file = tmp_path / "model.safetensors"
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="invalid header length|header too large|Error while deserializing"):
        list(tensor_names([file]))


def test_an_unsupported_gguf_architecture_is_named_before_its_layer_count_is_checked(tmp_path) -> None:
    """A T5 file's layers are ``enc.blk.N`` / ``dec.blk.N``: the block-count check found none and refused with
    "t5.block_count = 2, but its tensors hold 0 layer(s)" instead of naming the architecture."""
    import gguf
    import numpy as np

    from asyncinfer.errors import ModelLoadError
    from asyncinfer.models.loader import open_checkpoint
    from asyncinfer.models.registry import supported_architectures

    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    for i in range(2):
        writer.add_tensor(f"enc.blk.{i}.attn_q.weight", np.zeros((32, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as caught:
        open_checkpoint(path)
    supported = ", ".join(supported_architectures(gguf=True))  # llama, qwen2, qwen3, phi3, gemma2, gemma3, ...
    assert str(caught.value) == f"unsupported GGUF architecture 't5'; supported: {supported}"


@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_a_prequantized_hf_checkpoint_is_refused_from_its_config(tmp_path, method) -> None:
    """An AWQ (``qweight``/``qzeros``/``scales``) or FP8 (``weight_scale_inv``) checkpoint was refused only once its
    weights were read, as a list of missing or unexpected tensors, and ``plan_memory`` planned it as float weights."""
    import json

    from asyncinfer.errors import ModelLoadError
    from tests.helpers import tiny_hf_model

    directory = tmp_path / method
    tiny_hf_model("llama").save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (directory / "config.json").write_text(json.dumps(config))
    expected = (f"{directory / 'config.json'}: a pre-quantized checkpoint (quantization_config.quant_method = "
                f"'{method}') is not supported")
    with pytest.raises(ModelLoadError) as planned:
        AsyncEngine.plan_memory(directory)
    with pytest.raises(ModelLoadError) as loaded:
        _load(directory)
    assert str(planned.value).startswith(expected)
    assert expected in str(loaded.value) and "quantization=" in str(loaded.value)
