"""SmolLM2-135M-Instruct (Q4_1 GGUF) loaded by us vs transformers' own GGUF loading."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from asyncinfer.models import ModelConfig, load_model
from tests.helpers import SMOLLM2, PagedRunner

ATOL = 1e-4

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def ours(real_gguf):
    return load_model(real_gguf, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def reference(real_hf_reference):
    return real_hf_reference[0]


@pytest.fixture(scope="module")
def prompt_ids(ours):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def test_config_matches_transformers(ours, reference):
    # The one thing a Hugging Face config cannot say: the file stores Q4_1 projections and a Q8_0 head.
    assert ours.config.native_format == "q4_1"
    stored = dict(ours.config.stored_formats)  # every projection Q4_1, the head (the tied embedding) Q8_0
    assert stored.pop("lm_head") == stored.pop("embed_tokens") == "q8_0" and set(stored.values()) == {"q4_1"}
    assert len(stored) == 4 * ours.config.num_layers  # qkv, o, gate_up, down
    plain = dataclasses.replace(ours.config, native_format=None, stored_formats=())
    assert plain == ModelConfig.from_hf_config(reference.config)
    # The hand-written config of the size tests is this file's (its eps is stored as float32).
    assert dataclasses.replace(plain, rms_norm_eps=1e-5) == SMOLLM2


def test_weights_equal_transformers_own_gguf_loading(ours, reference):
    """Every tensor, dequantized and un-permuted by our loader, equals transformers' reading of the file.

    transformers undoes llama.cpp's q/k row permutation with its own code, so the q and k rows
    (9 query heads, 3 KV heads: two different permutations) check our un-permute against a
    reference we did not write.
    """
    q, kv, ffn = 9 * 64, 3 * 64, 1536
    mine = dict(ours.model.named_parameters())
    per_layer = {
        "input_layernorm.weight": ("input_norm.weight", slice(None)),
        "post_attention_layernorm.weight": ("post_attn_norm.weight", slice(None)),
        "self_attn.q_proj.weight": ("attn.qkv_proj.weight", slice(0, q)),
        "self_attn.k_proj.weight": ("attn.qkv_proj.weight", slice(q, q + kv)),
        "self_attn.v_proj.weight": ("attn.qkv_proj.weight", slice(q + kv, q + 2 * kv)),
        "self_attn.o_proj.weight": ("attn.o_proj.weight", slice(None)),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", slice(0, ffn)),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", slice(ffn, 2 * ffn)),
        "mlp.down_proj.weight": ("mlp.down_proj.weight", slice(None)),
    }
    compared = 0
    for name, theirs in reference.named_parameters():  # the tied lm_head is the embedding, listed once
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            ours_name, rows = name.removeprefix("model."), slice(None)
        else:
            layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
            ours_name, rows = per_layer[rest]
            ours_name = f"layers.{layer}.{ours_name}"
        assert torch.equal(mine[ours_name][rows], theirs), name
        compared += theirs.numel()
    assert compared == sum(p.numel() for p in mine.values()) == 134_515_008  # all of ours, nothing twice


def test_logits_match_transformers(ours, reference, prompt_ids):
    runner = PagedRunner(ours.model, num_blocks=16, block_size=16)
    half = len(prompt_ids) // 2
    first, second = runner.step([(0, prompt_ids[:half])]), runner.step([(0, prompt_ids[half:])])
    logits = torch.cat([first[0], second[0]])  # prefill, then a chunk on the cached prefix
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt_ids])).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_greedy_answer(ours, prompt_ids):
    tokens = PagedRunner(ours.model, num_blocks=16, block_size=16).greedy(0, prompt_ids, 6)
    assert "Paris" in ours.tokenizer.decode(tokens)
