"""SmolLM2-135M-Instruct (Q4_1 GGUF) loaded by us vs transformers' own GGUF loading."""

from __future__ import annotations

import pytest
import torch

from asyncinfer.models import ModelConfig, load_model
from tests.helpers import PagedRunner

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
    assert ours.config == ModelConfig.from_hf_config(reference.config)
    assert ours.config.tie_word_embeddings and ours.config.num_layers == 30


def test_logits_match_transformers(ours, reference, prompt_ids):
    runner = PagedRunner(ours.model, num_blocks=16, block_size=16)
    half = len(prompt_ids) // 2
    first, second = runner.step([(0, prompt_ids[:half])]), runner.step([(0, prompt_ids[half:])])
    logits = torch.cat([first[0], second[0]])  # prefill, then a chunk on the cached prefix
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt_ids])).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_greedy_answer(ours, prompt_ids):
    runner = PagedRunner(ours.model, num_blocks=16, block_size=16)
    (logits,) = runner.step([(0, prompt_ids)])
    tokens = [int(logits[-1].argmax())]
    for _ in range(5):
        (logits,) = runner.step([(0, tokens[-1:])])
        tokens.append(int(logits[-1].argmax()))
    assert "Paris" in ours.tokenizer.decode(tokens)
