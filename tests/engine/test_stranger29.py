"""The last stranger's first hour, in-process side: a service of one's own from docs/api.md, several users
calling one engine while its models change.

A ``generate()`` naming a model that was loaded at the call, whose prompt was still being made off the event
loop when ``remove_model`` came, was refused with ``model='second' is invalid: allowed a loaded generator:
['default']``, which reads as if the name had never been loaded; ``embed()`` in the same case said "(it was
removed meanwhile)". Both say so now (docs/models_and_embeddings.md)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams, catalog

OPTIONS = {"max_model_len": 2048, "num_threads": 1, "kv_cache_memory": 96 * 2**20}


@pytest.mark.real_model
async def test_a_request_whose_model_was_removed_while_its_prompt_was_made_says_so(real_gguf, monkeypatch) -> None:
    made, go = threading.Event(), threading.Event()
    real = catalog.prompt_token_ids

    def held(prompt, version):  # the off-loop tokenizing, held until the model is gone
        made.set()
        assert go.wait(60)
        return real(prompt, version)

    async with await AsyncEngine.load(real_gguf, **OPTIONS) as engine:
        await engine.add_model("second", real_gguf, **OPTIONS)
        monkeypatch.setattr(catalog, "prompt_token_ids", held)
        call = asyncio.ensure_future(engine.generate("hello " * 1000, SamplingParams(max_tokens=4), model="second"))
        assert await asyncio.to_thread(made.wait, 60)  # accepted at the call; its prompt is being made
        await engine.remove_model("second")
        go.set()
        with pytest.raises(InvalidParameterError) as refused:
            await asyncio.wait_for(call, 60)
        assert refused.value.parameter == "model" and refused.value.value == "second"
        assert "removed meanwhile" in str(refused.value), str(refused.value)
        monkeypatch.setattr(catalog, "prompt_token_ids", real)
        out = await engine.generate("hello " * 1000, SamplingParams(max_tokens=4))  # the others serve on
        assert out.finish_reason == "length" and engine.kv_stats().used_blocks == 0
