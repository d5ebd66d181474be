"""What the HTTP layer reads from the engine about a named model, through the public API only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncinfer.engine import AsyncEngine
from asyncinfer.errors import EngineClosedError, InvalidParameterError
from asyncinfer.holder import ModelVersionInfo
from asyncinfer.models.encoder import tokenize_texts


def generator_tokenizer(engine: AsyncEngine, model: str) -> Any:
    """The tokenizer of generator ``model`` (None without tokenizer files)."""
    return engine.get_tokenizer(model)


def without_tokenizer(engine: AsyncEngine, model: str) -> bool:
    """Whether generator ``model`` serves without a tokenizer (its completions carry token ids, their text is
    empty); False while no version of it serves (a drain-mode swap loading the next)."""
    try:
        return engine.get_tokenizer(model) is None
    except EngineClosedError:
        return False


def between_versions(engine: AsyncEngine, model: str | None) -> bool:
    """Whether ``model`` (None: the engine's default generator) is a generator with no version serving now (a
    drain-mode swap is loading its next one): it is in no ``model_info()`` entry then, but it is still served, and
    its requests are to come back shortly."""
    try:
        engine.get_tokenizer(model)
    except EngineClosedError:
        return True
    except InvalidParameterError:
        return False
    return False


def vacancy(engine: AsyncEngine, model: str | None) -> str | None:
    """Why generator ``model`` (None: the default one) has no version serving now (the engine's words), or None
    while one serves (or it is no generator of the engine)."""
    try:
        engine.get_tokenizer(model)
    except EngineClosedError as exc:
        return str(exc)
    except InvalidParameterError:
        return None
    return None


def serves(engine: AsyncEngine, model: str) -> bool:
    """Whether the engine takes new requests for ``model`` (now, or once a drain-mode swap's next version serves):
    False for a model being removed, which ``model_info()`` lists ("draining") until its last request ends."""
    try:
        engine.get_tokenizer(model)
    except EngineClosedError:  # between versions: still served
        return True
    except InvalidParameterError:
        return False
    return True


def _embedder_info(engine: AsyncEngine, model: str) -> ModelVersionInfo:
    return next(i for i in engine.model_info() if i.name == model and i.kind == "embed")


def embedding_token_counter(engine: AsyncEngine, model: str) -> Callable[[list[str]], list[int]]:
    """What counts the tokens each text costs embedding model ``model`` (truncated as it truncates), for
    ``usage``: its tokenizer and length, taken now, so that counting after the vectors came back needs the
    model no more (``remove_model`` may have unloaded it by then)."""
    max_len = _embedder_info(engine, model).memory_plan.max_seq_len  # type: ignore[union-attr]
    tokenizer = engine.get_tokenizer(model)

    def count(texts: list[str]) -> list[int]:  # each text read as far as the model reads it (all of it was 120x its size)
        return [len(ids) for ids in tokenize_texts(tokenizer, texts, max_len)]  # a few texts a tokenizer call
    return count


def embedding_dimension(engine: AsyncEngine, model: str) -> int:
    """The embedding model's vector size."""
    dim = _embedder_info(engine, model).embedding_dim
    assert dim is not None
    return dim
