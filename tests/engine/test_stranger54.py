"""A swap refused for an option the caller did not give says that the option is the serving version's."""

from __future__ import annotations

import json
import shutil

import pytest

from asyncinfer import AsyncEngine
from asyncinfer.conformance import tiny_model
from asyncinfer.errors import InvalidParameterError


@pytest.fixture(scope="module")
def two_contexts(tmp_path_factory):
    """The same tiny model with a context of 512 and of 256 tokens."""
    wide = tiny_model(tmp_path_factory.mktemp("wide"))
    narrow = tmp_path_factory.mktemp("narrow")
    shutil.copytree(wide, narrow, dirs_exist_ok=True)
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    return wide, narrow


@pytest.mark.parametrize("mode", ["overlap", "drain"])
async def test_a_carried_max_model_len_past_the_new_context_names_where_it_came_from(two_contexts, mode) -> None:
    """It said ``max_model_len=400 is invalid: allowed at most the model's context length 256`` to a caller who
    gave swap_model no max_model_len at all."""
    wide, narrow = two_contexts
    engine = await AsyncEngine.load(str(wide), max_model_len=400, num_threads=1)
    async with engine:
        with pytest.raises(InvalidParameterError) as info:
            await engine.swap_model(str(narrow), mode=mode)
        assert info.value.parameter == "max_model_len" and info.value.value == 400
        assert str(info.value) == ("max_model_len=400 is invalid: allowed at most the model's context length 256 "
                                   "(max_model_len is the serving version's, carried over: pass max_model_len= to "
                                   "swap_model for the new model)")
        assert [(v.source, v.state) for v in engine.model_info()] == [(f"safetensors:{wide}", "current")]
        with pytest.raises(InvalidParameterError) as given:  # given to swap_model: its own words, as before
            await engine.swap_model(str(narrow), mode=mode, max_model_len=300)
        assert str(given.value) == "max_model_len=300 is invalid: allowed at most the model's context length 256"
        info = await engine.swap_model(str(narrow), mode=mode, max_model_len=200)
        assert engine.max_model_len == 200 and info.source == f"safetensors:{narrow}"


def test_weights_a_rounding_away_from_fitting_show_their_exact_bytes(two_contexts) -> None:
    """Weights of 1.02 MiB against 1 MiB available read 'its weights need 1.0 MiB ... but 1.0 MiB are
    available': the refusal showed no shortfall at all."""
    from asyncinfer import ConfigurationError

    wide, _ = two_contexts
    weights = AsyncEngine.plan_memory(str(wide), quantization=None).weight_bytes
    with pytest.raises(ConfigurationError) as info:
        AsyncEngine.plan_memory(str(wide), quantization=None, available_bytes=weights - 1)
    assert str(info.value).startswith(
        f"the model does not fit: its weights need {weights / 2**20:.1f} MiB ({weights:,} bytes) (float32) but "
        f"{weights / 2**20:.1f} MiB ({weights - 1:,} bytes) are available on cpu; try ")
