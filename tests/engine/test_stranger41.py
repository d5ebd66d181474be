"""A version's ``source``, as ``model_info()`` reports it, names a model that loads and swaps (a rollback to it).

It read ``"gguf:<file>"`` / ``"safetensors:<dir>"``, which ``swap_model`` and ``from_pretrained`` refused as a missing
path, so an admin route swapping back to ``engine.model_info()[0].source`` got a ``SwapError``."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, ModelLoadError
from asyncinfer.model_source import resolve_model
from tests.helpers import ENGINE_BASE, greedy


async def test_a_version_source_swaps_back_to_that_model(tiny_models) -> None:
    llama, qwen2 = tiny_models["llama"][0], tiny_models["qwen2"][0]
    async with AsyncEngine.from_pretrained(llama, **ENGINE_BASE) as engine:
        first = engine.model_info()[0].source
        assert first.startswith("safetensors:")
        before = await engine.generate([1, 2, 3], greedy(8))
        await engine.swap_model(qwen2)
        info = await engine.swap_model(first)          # back to the first version's model
        assert info.source == first
        after = await engine.generate([1, 2, 3], greedy(8))
        assert after.token_ids == before.token_ids


def test_sources_resolve_to_their_files_and_a_missing_one_names_the_path(tiny_models, tmp_path) -> None:
    directory = tiny_models["llama"][0]
    assert resolve_model(f"safetensors:{directory}") == directory
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(f"gguf:{gguf}") == gguf
    with pytest.raises(ModelLoadError, match=repr(str(tmp_path / "gone.gguf"))):
        resolve_model(f"gguf:{tmp_path / 'gone.gguf'}")


def test_a_source_whose_prefix_names_the_other_kind_is_refused(tiny_models, tmp_path) -> None:
    """``gguf:<a model directory>`` loaded the directory's safetensors model, and ``safetensors:<a .gguf file>`` the
    file: a mistyped prefix went unnoticed, the model loaded as the other kind."""
    directory = tiny_models["llama"][0]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for model, allowed in ((f"gguf:{directory}", (f"a gguf source naming a .gguf file, not a directory (give "
                                                 f"'safetensors:{directory}' or the path alone)")),
                           (f"safetensors:{gguf}", (f"a safetensors source naming a model directory, not a file (give "
                                                   f"'gguf:{gguf}' or the path alone)"))):
        with pytest.raises(InvalidParameterError) as raised:
            resolve_model(model)
        assert (raised.value.parameter, raised.value.allowed) == ("model", allowed)


@pytest.mark.parametrize("model", ["gguf:", "safetensors:", "gguf:  "])
def test_a_source_naming_nothing_is_refused_not_the_working_directory(model, tiny_models, monkeypatch) -> None:
    """``Path("")`` is the working directory: ``--model "gguf:$UNSET"`` resolved to it and loaded whatever model lay
    there (the plain empty string was refused for that reason)."""
    monkeypatch.chdir(tiny_models["llama"][0])  # a model directory: it loaded
    with pytest.raises(InvalidParameterError, match="model") as raised:
        resolve_model(model)
    assert raised.value.parameter == "model"


def test_a_source_is_a_path_never_a_known_name(tmp_path, monkeypatch) -> None:
    """``gguf:<x>`` names a file: ``gguf:SmolLM2-135M-Instruct`` (no such file here) is a missing path, not the
    default model's safetensors directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="'SmolLM2-135M-Instruct' does not exist"):
        resolve_model("gguf:SmolLM2-135M-Instruct")
