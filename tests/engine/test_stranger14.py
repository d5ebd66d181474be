"""A fourteenth stranger's first hour with the engine from Python: what misled, each held to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError
from tests.helpers import ENGINE_BASE


async def test_swapping_an_embedding_model_says_how_to_replace_it(tiny_models, minilm_dir) -> None:
    """``swap_model(..., name="minilm")`` on an embedding model said "(an embedding model: use embed())": embed()
    replaces nothing. swap_model replaces generators; an embedding model is removed, then added again."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        await engine.add_model("minilm", minilm_dir)
        with pytest.raises(InvalidParameterError) as err:
            await engine.swap_model(minilm_dir, name="minilm")
        assert err.value.parameter == "name"
        assert str(err.value) == ("name='minilm' is invalid: allowed a loaded generator: ['default'] (an embedding "
                                  "model, which swap_model does not replace: remove_model(name), then "
                                  "add_model(name, model))")
        with pytest.raises(InvalidParameterError) as err:  # elsewhere the hint is the call that serves it
            engine.kv_stats(model="minilm")
        assert str(err.value).endswith("(an embedding model: use embed())")
        assert [info.name for info in engine.model_info()] == ["default", "minilm"]  # nothing was changed
