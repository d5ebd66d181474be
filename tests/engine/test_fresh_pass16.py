"""A sixteenth adversarial pass over the engine: each finding held to its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError
from asyncinfer.model_source import resolve_model

OPTS = {"device": "cpu", "kv_cache_memory": 2**22, "max_model_len": 64}


@pytest.mark.parametrize("model", ["", " ", "\t\n"])
async def test_an_empty_model_is_refused_not_the_working_directory(tiny_models, tmp_path, monkeypatch, model) -> None:
    """``Path("")`` is ``.``: ``AsyncEngine.from_pretrained("")`` (``asyncinfer serve -m "$MODEL"`` with the variable
    unset) loaded whatever model lay in the working directory, with no word of it. An empty or blank model is the
    model's InvalidParameterError, wherever a model is named; nothing loads."""
    shutil.copytree(tiny_models["llama"][0], tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)  # a model in the working directory, which "" reached
    assert resolve_model(".") == Path(".")  # the working directory, asked for by name, is still served
    with pytest.raises(InvalidParameterError, match="not an empty string") as info:
        resolve_model(model)
    assert info.value.parameter == "model"
    with pytest.raises(InvalidParameterError, match="not an empty string"):
        AsyncEngine.from_pretrained(model, **OPTS)
    with pytest.raises(InvalidParameterError, match="not an empty string"):
        AsyncEngine.plan_memory(model, **OPTS)
    with pytest.raises(InvalidParameterError, match="not an empty string"):
        await AsyncEngine.load(model, **OPTS)
    engine = await AsyncEngine.load(".", **OPTS)
    async with engine:
        with pytest.raises(InvalidParameterError, match="not an empty string"):
            await engine.add_model("second", model, **OPTS)
        assert [info.name for info in engine.model_info()] == ["default"]
