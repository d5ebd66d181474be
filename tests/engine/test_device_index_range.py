"""A ``device`` given as an int past a C long (``10**400``) is refused with ``InvalidParameterError`` naming ``device``
in ``EngineConfig`` and ``EmbeddingConfig``: torch's ``ValueError`` ("Overflow when unpacking long long") came out
bare."""

from __future__ import annotations

import pytest

from asyncinfer import EngineConfig
from asyncinfer.embedding import EmbeddingConfig
from asyncinfer.errors import InvalidParameterError


@pytest.mark.parametrize("config", [EngineConfig, EmbeddingConfig])
def test_a_device_index_past_a_long_is_refused_naming_device(config: type) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        config(device=10**400)
    assert caught.value.parameter == "device"
    assert caught.value.allowed == "'cpu', 'cuda', 'cuda:N' or 'auto'"
