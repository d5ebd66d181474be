"""stranger25: a swap or add_model whose options leave no room for one request (a KV cache smaller than one
``max_model_len`` request) says so, not that the model "does not fit beside" the loaded ones, which no memory
would mend; a swap adds that the options it was not given are the serving version's."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, ConfigurationError

OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_threads": 1}


async def test_a_swap_with_a_kv_cache_too_small_for_one_request_names_the_options(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    engine = await AsyncEngine.load(path, kv_cache_memory=1 << 20, **OPTIONS)
    async with engine:
        for mode in ("overlap", "drain"):
            with pytest.raises(ConfigurationError) as err:
                await engine.swap_model(path, kv_cache_memory=4096, mode=mode)
            message = str(err.value)
            assert message.startswith("the new model cannot run with these options, whatever memory is free: ")
            assert "beside" not in message and "max_model_len=256" in message
            assert message.endswith("(the options not given to swap_model are the serving version's)")
        assert [v.version_id for v in engine.model_info()] == [0]  # nothing loaded, nothing drained


async def test_add_model_with_a_kv_cache_too_small_for_one_request_names_the_options(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    engine = await AsyncEngine.load(path, kv_cache_memory=1 << 20, **OPTIONS)
    async with engine:
        with pytest.raises(ConfigurationError) as err:
            await engine.add_model("second", path, kv_cache_memory=4096, **OPTIONS)
        message = str(err.value)
        assert message.startswith("the new model cannot run with these options, whatever memory is free: ")
        assert "beside" not in message and "swap_model" not in message


async def test_a_swap_short_of_memory_still_says_beside_what(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    engine = await AsyncEngine.load(path, kv_cache_memory=1 << 20, **OPTIONS)
    async with engine:
        with pytest.raises(ConfigurationError) as err:
            await engine.swap_model(path, available_bytes=1000)
        assert str(err.value).startswith("the new model does not fit beside the serving one: ")
