"""load_model: HF directories (single/sharded safetensors), synthetic GGUF, and every error path."""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncinfer.errors import ModelLoadError
from asyncinfer.models import LoadedModel, load_model
from tests.helpers import PagedRunner, hf_logits, tiny_hf_model

ATOL = 1e-4


def _save(hf, path, **kwargs):
    hf.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def _prefill_logits(loaded: LoadedModel, tokens):
    (logits,) = PagedRunner(loaded.model).step([(0, tokens)])
    return logits


def test_sharded_checkpoint(tmp_path):
    hf = tiny_hf_model("qwen2")
    _save(hf, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert loaded.tokenizer is None  # tiny dirs have no tokenizer files
    assert loaded.source == f"safetensors:{tmp_path.resolve()}"
    tokens = list(range(5, 25))
    torch.testing.assert_close(_prefill_logits(loaded, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_loaded_model_state(tmp_path):
    _save(tiny_hf_model("llama"), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(tmp_path, torch.bfloat16, "cpu")
    assert loaded.config.eos_token_ids == (2, 7)  # merged from generation_config.json
    for name, p in loaded.model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16 and not p.requires_grad, name
    assert loaded.model.rotary.cos_cache.device.type == "cpu"
    assert loaded.model.rotary.cos_cache.shape == (256, 8)
    assert loaded.model.compute_logits(torch.zeros(3, 64, dtype=torch.bfloat16)).dtype == torch.float32


def test_a_config_whose_sizes_are_not_its_weights_says_where_the_sizes_came_from(tmp_path):
    """A vocab_size edited in config.json: the shape refusal named the tensor only, not config.json (stranger79)."""
    _save(tiny_hf_model("llama"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rows = config["vocab_size"]
    config["vocab_size"] = rows - 20
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape(
            f"has shape ({rows}, 64), expected ({rows - 20}, 64) (for parameter 'lm_head.weight', from "
            "config.json's sizes: do they belong to these weights?)")):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_path_raises(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, "cpu")


def test_not_a_model_raises(tmp_path):
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_model(tmp_path, torch.float32, "cpu")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a model"):
        load_model(tmp_path / "weights.bin", torch.float32, "cpu")
    (tmp_path / "broken.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(tmp_path / "broken.gguf", torch.float32, "cpu")


def test_unsupported_architecture_raises(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'"):
        load_model(tmp_path, torch.float32, "cpu")


def _rewrite_checkpoint(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_shape_mismatch_names_the_tensor(tmp_path):
    _save(tiny_hf_model("llama"), tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_checkpoint(tmp_path, lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(ModelLoadError, match=re.escape(f"'{name}' has shape (16, 64), expected (32, 64)")):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_tensor_raises(tmp_path):
    _save(tiny_hf_model("llama"), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\): model.layers.0.mlp.up_proj.weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unexpected_tensor_raises(tmp_path):
    _save(tiny_hf_model("llama"), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match="unexpected tensor.*model.layers.0.extra.weight"):
        load_model(tmp_path, torch.float32, "cpu")


# ---- GGUF --------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its documented behaviour; the
    synthetic test below has transformers' GGUF reader confirm it, and test_real_gguf.py checks
    our un-permute on the real SmolLM2 file against transformers)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight", r"blk.\1.attn_\2.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2.weight"),
]


def _gguf_name(hf_name: str) -> str:
    for pattern, repl in _GGUF_NAMES:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, repl, hf_name)
    raise KeyError(hf_name)


def test_synthetic_gguf_matches_hf(tmp_path):
    """Write a tiny llama as GGUF (F32 norms, F16 attention, Q8_0 MLP, permuted q/k) and compare logits."""
    hf = tiny_hf_model("llama")
    cfg = hf.config
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_vocab_size(cfg.vocab_size)  # transformers' reader needs it without a tokenizer
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            w = p.numpy()
            if "mlp" in name:
                q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)))
                data, dtype = q8, gguf.GGMLQuantizationType.Q8_0
            elif w.ndim == 2:
                p.copy_(p.half().float())  # make the reference see the stored fp16 values
                data, dtype = p.numpy().astype(np.float16), None
            else:
                data, dtype = w.copy(), None
            if name.endswith("q_proj.weight"):
                data = llama_cpp_permute(data, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                data = llama_cpp_permute(data, cfg.num_key_value_heads)
            writer.add_tensor(_gguf_name(name), data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # An independent reader of the file (transformers' GGUF loader, with its own un-permute) gets
    # the HF weights back: the file is laid out as llama.cpp lays it out, permuted q/k rows included.
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = dict(hf.named_parameters())
    for name, p in theirs.named_parameters():
        assert torch.equal(p, expected[name]), name
    assert len(dict(theirs.named_parameters())) == len(expected)

    loaded = load_model(path, torch.float32, "cpu")
    assert loaded.tokenizer is None and loaded.source == f"gguf:{path.resolve()}"
    assert not loaded.config.tie_word_embeddings and loaded.config.vocab_size == cfg.vocab_size
    tokens = list(range(30, 70))
    torch.testing.assert_close(_prefill_logits(loaded, tokens), hf_logits(hf, tokens), atol=ATOL, rtol=0)
