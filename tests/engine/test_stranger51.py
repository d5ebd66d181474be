"""stranger51: ``engine.config`` speaks of the default generator's serving version, as docs/api.md says of it: a
``swap_model`` with options changes it (it kept the first load's options, so after ``swap_model(max_model_len=200)``
``engine.config.max_model_len`` still said the old length beside ``engine.max_model_len``), a removed default hands
it to the next generator, and it cannot be assigned (it was a plain attribute)."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, ModelChangedError, SamplingParams

OPTIONS = {"device": "cpu", "dtype": "float32", "num_threads": 1, "kv_cache_memory": 1 << 20}
P = SamplingParams(max_tokens=2)


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


async def test_a_version_id_of_another_model_is_not_blamed_on_a_swap(tiny_models) -> None:
    """Version ids are the engine's, shared by its models: another model's id is older than a swapped model's serving
    one, and was blamed on 'a swap_model came in between' (for a model never swapped too)."""
    path, _ = tiny_models["llama"]
    engine = await AsyncEngine.load(path, max_model_len=64, **OPTIONS)
    async with engine:
        second = await engine.add_model("second", path, max_model_len=64, **OPTIONS)  # version 1
        swapped = await engine.swap_model(path)  # the default's version 2
        for model, version_id, serving in ((None, second.version_id, swapped.version_id), ("second", 0, 1)):
            for call in ("generate", "stream"):
                with pytest.raises(ModelChangedError) as err:
                    if call == "generate":
                        await engine.generate([1, 2], P, version_id=version_id, model=model)
                    else:
                        [d async for d in engine.stream([1, 2], P, version_id=version_id, model=model)]
                assert (err.value.version_id, err.value.serving) == (version_id, serving)
                assert "(no version of that id has served this model)" in str(err.value)
        with pytest.raises(ModelChangedError) as err:  # the default's own old version: a swap came in between
            await engine.generate([1, 2], P, version_id=0)
        assert "(a swap_model came in between)" in str(err.value)
