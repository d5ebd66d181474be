"""In-process misuse found by a fourth fresh adversarial pass (issue 25): values whose type lies, in the calls
that load, add and configure models (the earlier passes hardened the request calls).

A model's name given as a ``str`` subclass was checked with the subclass's own ``len()`` and kept as it came:
one whose ``__len__`` said 3 passed the 200-character limit with a name of a hundred thousand characters, and
that name was then in the labels of every metric series of every ``/metrics`` scrape (21 MB of exposition) and
in every ``/v1/models`` answer. The name is now the plain ``str`` it holds, checked by its real length.

``EngineConfig`` and ``EmbeddingConfig`` checked their numbers as they came, as the request calls did before
the third pass: an ``int`` subclass whose comparisons answer as another number passed every range check with
what it held (a ``block_size`` of 0 failed the load with a bare ``ZeroDivisionError`` wrapped as a load failure;
a ``max_num_seqs`` of -3 and a ``max_num_batched_tokens`` of 0 served). ``add_model``'s and ``swap_model``'s
``available_bytes`` likewise (``swap_model`` did not check it at all). Each is now the plain number it holds.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer import AsyncEngine, EngineConfig, InvalidParameterError, SamplingParams
from asyncinfer.embedding import EmbeddingConfig
from asyncinfer.metrics.exposition import exposition
from tests.helpers import Posing, PosingFloat

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


class ShortSaying(str):
    """A str whose ``len()`` says 3, whatever it holds."""

    def __len__(self) -> int:
        return 3


async def test_a_model_name_whose_len_lies_is_refused_by_its_real_length(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 6)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    long_name = ShortSaying("x" * 100_000)
    with pytest.raises(InvalidParameterError) as refused:
        AsyncEngine.from_pretrained(path, name=long_name, **BASE)
    assert refused.value.parameter == "name"
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        with pytest.raises(InvalidParameterError) as refused:
            await engine.add_model(long_name, path, **BASE)
        assert refused.value.parameter == "name"
        assert [info.name for info in engine.model_info()] == ["default"]
        info = await engine.add_model(ShortSaying("second"), path, **BASE)
        assert type(info.name) is str and info.name == "second"
        assert all(type(i.name) is str for i in engine.model_info())
        assert len(exposition(engine)) < 1_000_000
        own, other = await asyncio.gather(engine.generate(GOOD, greedy, model="second"), engine.generate(GOOD, greedy))
        assert own.token_ids == other.token_ids == expected


POSING_OPTIONS = [  # (config, field, value)
    (EngineConfig, "block_size", Posing(0, 4)),
    (EngineConfig, "max_num_seqs", Posing(-3, 4)),
    (EngineConfig, "max_num_batched_tokens", Posing(0, 256)),
    (EngineConfig, "kv_cache_memory", Posing(-1, 4 << 20)),
    (EngineConfig, "max_consecutive_step_failures", Posing(0, 3)),
    (EngineConfig, "kv_cache_fraction", PosingFloat(7.0, 0.5)),
    (EngineConfig, "stall_timeout", PosingFloat(-1.0, 0.5)),
    (EngineConfig, "kv_watermark", PosingFloat(9.0, 0.5)),
    (EmbeddingConfig, "max_batch_size", Posing(0, 8)),
    (EmbeddingConfig, "max_batch_tokens", Posing(-5, 64)),
    (EmbeddingConfig, "max_wait_ms", PosingFloat(1e9, 0.5)),
]


@pytest.mark.parametrize(("config", "field", "value"), POSING_OPTIONS, ids=[f for _, f, _ in POSING_OPTIONS])
def test_an_option_that_poses_as_in_range_is_refused_by_name(config, field, value) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        config(device="cpu", **{field: value})
    assert refused.value.parameter == field


def test_options_keep_the_plain_numbers_they_hold() -> None:
    config = EngineConfig(device="cpu", block_size=Posing(8, 8), max_num_seqs=Posing(3, 3), seed=Posing(5, 5))
    assert (type(config.block_size), type(config.max_num_seqs), type(config.seed)) == (int, int, int)
    assert (config.block_size, config.max_num_seqs, config.seed) == (8, 3, 5)


async def test_a_load_with_a_posing_block_size_is_refused_by_name_and_the_engine_serves(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 6)
    with pytest.raises(InvalidParameterError) as refused:
        await AsyncEngine.load(path, **{**BASE, "block_size": Posing(0, 4)})
    assert refused.value.parameter == "block_size"
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        for call in (engine.add_model("second", path, available_bytes=Posing(-1, 1 << 40), **BASE),
                     engine.swap_model(path, available_bytes=Posing(-1, 1 << 40), **BASE),
                     engine.add_model("third", path, **{**BASE, "max_num_seqs": Posing(-3, 4)})):
            with pytest.raises(InvalidParameterError) as refused:
                await call
            assert refused.value.parameter in ("available_bytes", "max_num_seqs")
        assert [info.name for info in engine.model_info()] == ["default"]
        answer = await engine.generate(GOOD, SamplingParams(max_tokens=6, ignore_eos=True))
        assert answer.token_ids == expected


# A model argument that is no string (a list, a dict) was hashed as a dict key before any check: get_tokenizer,
# remove_model and swap_model raised a bare TypeError ("unhashable type"), and swap_model's refusal was lost in
# the metrics' count of it. Each is now the InvalidParameterError naming the argument.
async def test_a_model_argument_that_is_no_string_is_refused_by_name(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 6)
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        with pytest.raises(InvalidParameterError) as refused:
            engine.get_tokenizer(["default"])  # type: ignore[arg-type]
        assert refused.value.parameter == "model"
        for call in (engine.remove_model(["default"]), engine.swap_model(path, name=["default"], **BASE),  # type: ignore[arg-type]
                     engine.remove_model({"default": 1})):  # type: ignore[arg-type]
            with pytest.raises(InvalidParameterError) as refused:
                await call
            assert refused.value.parameter == "name"
        assert [info.name for info in engine.model_info()] == ["default"]
        assert (await engine.generate(GOOD, SamplingParams(max_tokens=6, ignore_eos=True))).token_ids == expected
