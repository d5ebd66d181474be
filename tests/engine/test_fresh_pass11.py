"""Adversarial pass 11 (in-process side): faults a hostile or careless caller sharing one engine could cause, found
and fixed."""

from __future__ import annotations

import asyncio
import os

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

BASE = {
    "kv_cache_memory": 4 * 1024 * 1024,
    "max_model_len": 512,
    "dtype": "float32",
    "device": "cpu",
    "block_size": 4,
    "num_threads": 1,
}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"][0]


@pytest.fixture
async def engine(llama):
    engine = await AsyncEngine.load(llama, **BASE)
    async with engine:
        yield engine


# ----------------------------------------------------------------- a model reference of another type is named
@pytest.mark.parametrize("model", [5, 3.5, b"/tmp/model", object()], ids=["int", "float", "bytes", "object"])
async def test_a_model_that_is_not_a_path_or_a_name_is_an_invalid_parameter_at_every_entry(engine, model) -> None:
    """``model=5`` (or bytes, a float, any object) reached ``Path(model)`` and raised Python's TypeError ("expected
    str, bytes or os.PathLike object") from ``from_pretrained``, ``load``, ``plan_memory``, ``swap_model`` and
    ``add_model``; it is an InvalidParameterError naming ``model`` now, and the engine serves on."""
    for call in (lambda: AsyncEngine.from_pretrained(model, **BASE), lambda: AsyncEngine.plan_memory(model, **BASE)):
        with pytest.raises(InvalidParameterError) as info:
            call()
        assert info.value.parameter == "model"
    for entry in (AsyncEngine.load(model, **BASE), engine.swap_model(model), engine.add_model("other", model)):
        with pytest.raises(InvalidParameterError) as info:
            await entry
        assert info.value.parameter == "model"
    out = await engine.generate(GOOD, SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3
    assert [info.name for info in engine.model_info()] == ["default"]


# ----------------------------------------------------------------- profile(): a path with a NUL is named
async def test_a_profile_path_with_a_nul_is_an_invalid_parameter_and_the_profile_slot_stays_free(
    engine, tmp_path
) -> None:
    """``engine.profile(3, "dir\\0x")`` raised os's ValueError ("embedded null byte") from the directory check, not
    the InvalidParameterError naming ``path`` that an uncreatable directory gets; a profile with a good path then
    runs."""
    with pytest.raises(InvalidParameterError) as info:
        await engine.profile(3, str(tmp_path / "a\0b"))
    assert info.value.parameter == "path"
    assert "NUL" in info.value.allowed
    # a profile waits for the engine's next steps: traffic until it has them (one short request could end while
    # the profile's directory check runs in a thread, and the profile would then wait on an idle engine)
    profile = asyncio.create_task(engine.profile(2, tmp_path / "ok"))
    deadline = asyncio.get_running_loop().time() + 60
    while not profile.done() and asyncio.get_running_loop().time() < deadline:
        await engine.generate(GOOD, SamplingParams(max_tokens=2))
    result = await asyncio.wait_for(profile, 1)
    assert (tmp_path / "ok" / "trace.json").exists() and result is not None


# ----------------------------------------------------------------- plan_memory(): available_bytes is checked
@pytest.mark.parametrize(
    "available", [-1, True, 1.5, float("nan"), "1GiB"], ids=["negative", "bool", "float", "nan", "str"]
)
def test_plan_memory_names_a_bad_available_bytes_as_swap_model_does(llama, available) -> None:
    """``AsyncEngine.plan_memory(model, available_bytes=-1)`` (or True, 1.5, NaN) was taken as a byte count and
    reported a ConfigurationError "the weights need 0.4 MiB but -0.0 MiB (nan MiB) are available", where
    ``swap_model``/``add_model`` refuse the same value as an InvalidParameterError naming ``available_bytes``; the
    string crashed in the arithmetic. Every entry checks it alike now, ``asyncinfer.memory.plan_memory`` too."""
    from asyncinfer.memory import plan_memory
    from asyncinfer.model_source import resolve_model
    from asyncinfer.models.loader import read_model_config

    config = read_model_config(resolve_model(llama))
    for call in (
        lambda: AsyncEngine.plan_memory(llama, available_bytes=available, **BASE),
        lambda: AsyncEngine.plan_memory(config, available_bytes=available, **BASE),
        lambda: plan_memory(llama, available_bytes=available, **BASE),
    ):
        with pytest.raises(InvalidParameterError) as info:
            call()
        assert info.value.parameter == "available_bytes"
    assert AsyncEngine.plan_memory(llama, available_bytes=2**34, **BASE).num_blocks > 0


# ----------------------------------------------------------------- swap_model(name=...) names name
@pytest.mark.parametrize("name", ["nope", ""], ids=["unknown", "empty"])
async def test_swap_model_names_its_name_keyword_for_a_name_that_is_no_generator(engine, llama, name) -> None:
    """``swap_model(path, name="nope")`` raised an InvalidParameterError naming ``model='nope'``, a keyword the caller
    did not pass with that value (``model`` was the path); it names ``name`` now, as ``remove_model`` does, and the
    engine serves on."""
    with pytest.raises(InvalidParameterError) as info:
        await engine.swap_model(llama, name=name)
    assert info.value.parameter == "name"
    assert info.value.value == name
    out = await engine.generate(GOOD, SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3


class _BytesPath(os.PathLike):
    def __fspath__(self) -> bytes:  # type: ignore[override]
        return b"/tmp/asyncinfer-profile-bytes"


async def test_a_profile_path_whose_fspath_is_bytes_is_an_invalid_parameter(engine) -> None:
    """An ``os.PathLike`` whose ``__fspath__`` gives bytes passed the path check and raised pathlib's TypeError
    ("argument should be a str object or an os.PathLike object returning str"); it is named as ``path`` now."""
    with pytest.raises(InvalidParameterError) as info:
        await engine.profile(2, _BytesPath())
    assert info.value.parameter == "path"
    out = await engine.generate(GOOD, SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3
