"""A twelfth stranger's first hour with the library: what misled, each held to its fix."""

from __future__ import annotations

import logging

import pytest

from asyncinfer import AsyncEngine, config
from asyncinfer.embedding import EmbeddingConfig


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(config, "_WARNED_SLOW_DTYPES", set())
    monkeypatch.setattr(config, "cpu_has_fast_matmul", lambda d: False)


def _slow_dtype_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncinfer" and "is slow on this CPU" in r.getMessage()]


def test_a_sentence_encoder_in_float16_is_warned_in_an_encoders_terms(fresh_warnings, minilm_dir, caplog) -> None:
    """``asyncinfer embed --dtype float16`` warned with the generator's advice ("the weights kept small by
    quantization='auto', float16 or the GGUF file's own blocks"): an encoder has no weight format, and its
    faster choice is float32."""
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        engine = AsyncEngine.from_pretrained(str(minilm_dir), dtype="float16", device="cpu")
    assert engine.model_info()[0].kind == "embed"
    assert _slow_dtype_warnings(caplog) == [
        ("dtype=float16 is slow on this CPU (it has no native float16 matrix kernels, so each one is emulated): "
        "dtype='auto' (--dtype auto: float32 on a CPU) is faster (docs/formats.md)")]


def test_an_encoders_options_warn_once_and_not_for_float32(fresh_warnings, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        EmbeddingConfig(dtype="float32", device="cpu")
        EmbeddingConfig(device="cpu")
        assert _slow_dtype_warnings(caplog) == []
        EmbeddingConfig(dtype="bfloat16", device="cpu")
        EmbeddingConfig(dtype="bfloat16", device="cpu")
    assert len(_slow_dtype_warnings(caplog)) == 1
