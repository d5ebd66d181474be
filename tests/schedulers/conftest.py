"""A tiny random Llama checkpoint on disk (the same recipe as tests/engine/conftest.py).

Copied rather than imported: the suite runs with ``--import-mode=importlib``,
where one directory's conftest is not importable from another.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved as safetensors; weights wide enough that greedy is stable."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=False),
                                             attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("tiny-llama-sched")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def cpu_cost():
    """The shipped SmolLM2-135M CPU cost model's coefficients, pinned (rounded) so that a
    recalibration on another machine does not move these tests' ground."""
    from asyncinfer.lab import StepCostModel

    return StepCostModel({"const": 0.061, "tokens": 0.00248, "sampled": 0.0, "prefill_seqs": 0.00247,
                          "decode_keys": 2.14e-05, "prefill_keys": 9.3e-07})
