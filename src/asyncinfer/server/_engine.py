"""What the HTTP layer needs from the engine that :class:`AsyncEngine` does not offer publicly yet.

Each function is the one place that reaches past the public API, and says which
public call would replace it. Nothing else in ``asyncinfer.server`` does.
"""

from __future__ import annotations

from typing import Any

from asyncinfer.catalog import current
from asyncinfer.engine import AsyncEngine


def generator_tokenizer(engine: AsyncEngine, model: str) -> Any:
    """The tokenizer of generator ``model`` (None without tokenizer files).

    ``engine.tokenizer`` covers only the default generator; a public
    ``engine.tokenizer_of(model)`` would replace this.
    """
    return current(engine._models.generator(model)).tokenizer


def embedding_token_counts(engine: AsyncEngine, model: str, texts: list[str]) -> list[int]:
    """Tokens each text costs the embedding model (truncated as it truncates), for ``usage``.

    A count returned by ``embed()`` itself would replace this second tokenization.
    """
    return [len(ids) for ids in engine._models.embedder(model).batcher.encoder.tokenize(texts)]


def embedding_dimension(engine: AsyncEngine, model: str) -> int:
    """The embedding model's vector size (a public field of its ``ModelVersionInfo`` would replace this)."""
    return int(engine._models.embedder(model).batcher.encoder.dimension)
