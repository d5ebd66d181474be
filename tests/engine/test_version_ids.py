"""Version ids count the loads that served: each ``add_model`` and swap takes the next number, an embedding model
too. An embedding model's load drew one id and its entry another, so the ids a user saw skipped a number after
every embedding model."""

from __future__ import annotations

import asyncio

from asyncinfer import AsyncEngine

TINY = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "dtype": "float32", "device": "cpu"}


def test_each_load_takes_the_next_id_embedding_models_too(tiny_models, minilm_dir) -> None:
    llama = str(tiny_models["llama"][0])

    async def scenario() -> list[int]:
        async with await AsyncEngine.load(llama, **TINY) as engine:
            first = engine.model_info()[0].version_id
            ids = [first]
            ids.append((await engine.add_model("e1", str(minilm_dir))).version_id)
            ids.append((await engine.add_model("g2", llama, **TINY)).version_id)
            ids.append((await engine.add_model("e2", str(minilm_dir))).version_id)
            ids.append((await engine.swap_model(llama, **TINY)).version_id)
            return ids

    ids = asyncio.run(scenario())
    assert ids == list(range(ids[0], ids[0] + 5)), ids
