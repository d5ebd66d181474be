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


async def test_a_version_id_that_never_served_is_not_blamed_on_a_swap(tiny_models) -> None:
    """``generate(..., version_id=99)`` on an engine whose model never swapped said "(a swap_model came in between)".
    An id newer than the serving one was never its serving version: the error says so, and names where the id
    comes from. The error stays ``ModelChangedError`` (nothing queued), with the serving version."""
    from asyncinfer import ModelChangedError, SamplingParams

    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        with pytest.raises(ModelChangedError) as err:
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=1), version_id=99)
        assert (err.value.version_id, err.value.serving) == (99, 0)
        assert str(err.value) == ("the prompt was made for version 99 of the model, and version 0 serves it now (no "
                                  "version of that id has served this model): make the prompt again with the serving "
                                  "version (model_info()'s version_id)")
        assert engine.num_unfinished_requests == 0
