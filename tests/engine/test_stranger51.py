"""stranger51: ``engine.config`` speaks of the default generator's serving version, as docs/api.md says of it: a
``swap_model`` with options changes it (it kept the first load's options, so after ``swap_model(max_model_len=200)``
``engine.config.max_model_len`` still said the old length beside ``engine.max_model_len``), a removed default hands
it to the next generator, and it cannot be assigned (it was a plain attribute)."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine

OPTIONS = {"device": "cpu", "dtype": "float32", "num_threads": 1, "kv_cache_memory": 1 << 20}


async def test_config_follows_the_default_generators_serving_version(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    engine = await AsyncEngine.load(path, max_model_len=256, max_num_seqs=7, **OPTIONS)
    async with engine:
        assert (engine.config.max_model_len, engine.config.max_num_seqs) == (256, 7)
        for mode in ("overlap", "drain"):
            await engine.swap_model(path, mode=mode, max_model_len=128, max_num_seqs=3)
            assert (engine.config.max_model_len, engine.config.max_num_seqs) == (128, 3)
            assert engine.config.max_model_len == engine.max_model_len
        await engine.swap_model(path)  # the options not given carry over
        assert (engine.config.max_model_len, engine.config.max_num_seqs) == (128, 3)
        await engine.add_model("second", path, max_model_len=64, max_num_seqs=5, **OPTIONS)
        assert engine.config.max_num_seqs == 3  # still the default generator's
        await engine.remove_model("default")
        assert (engine.config.max_model_len, engine.config.max_num_seqs) == (64, 5)
        with pytest.raises(AttributeError):
            engine.config = engine.config  # type: ignore[misc]
