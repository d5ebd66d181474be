"""A forty-fourth stranger's first hour with embeddings beside generation: what misled, each held to its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import InvalidParameterError
from asyncinfer.embedding import EmbeddingConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_options_table_states_max_seq_lens_upper_bound() -> None:
    """docs/models_and_embeddings.md gave ``max_seq_len``'s range as ``2..its positions``, but a value past 8192 is
    refused whatever the model (an encoder of 16,384 positions included), so ``max_seq_len=1`` was answered
    "allowed an integer in [2, 8192]", a bound the page never named."""
    with pytest.raises(InvalidParameterError) as info:
        EmbeddingConfig(max_seq_len=8193)
    assert str(info.value) == "max_seq_len=8193 is invalid: allowed an integer in [2, 8192]"
    EmbeddingConfig(max_seq_len=8192)
    row = next(line for line in (ROOT / "docs" / "models_and_embeddings.md").read_text(encoding="utf-8").splitlines()
               if line.startswith("| `max_seq_len` |"))
    assert row.split("|")[3].strip() == "2..its positions, at most 8192 (512 for MiniLM)"
