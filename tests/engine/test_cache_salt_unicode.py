"""A ``cache_salt`` holding a lone surrogate is refused naming it (pass70), as a prompt, a tenant or a request id
holding one is: it was taken, the one text a caller gives that was not checked."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError
from tests.helpers import ENGINE_BASE, greedy


async def test_a_salt_that_is_no_valid_unicode_is_refused_by_name(tiny_models) -> None:
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE) as engine:
        with pytest.raises(InvalidParameterError) as refused:
            await engine.generate([1, 2, 3], greedy(2), cache_salt="salt\ud800")
        assert refused.value.parameter == "cache_salt"
        assert refused.value.value == "<a text with the lone surrogate '\\ud800' at index 4>"
        assert engine.num_unfinished_requests == 0
        out = await engine.generate([1, 2, 3], greedy(2), cache_salt="salt é")
    assert len(out.token_ids) == 2
