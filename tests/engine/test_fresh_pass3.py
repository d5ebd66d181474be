"""In-process misuse found by a third fresh adversarial pass (issue 25): values whose type lies.

The engine already copied a ``str`` or ``list`` subclass into the plain value it holds before checking it,
but took an ``int`` subclass as it came, and such an int's comparisons are its own: one whose ``__lt__`` and
``__ge__`` always answer True passes every range check whatever it holds. A token id of a million in a
prompt (the vocabulary has 320) passed ``0 <= t < vocab_size`` and failed, with an ``IndexError`` in the
model's embedding, the step of every request batched with it.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.prompts import plain_prompt

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


class Posing(int):
    """An int that compares as another number (``poses_as``), whatever it holds."""

    poses_as: float

    def __new__(cls, value: int, poses_as: float) -> Posing:
        number = super().__new__(cls, value)
        number.poses_as = poses_as
        return number

    def __lt__(self, other: object) -> bool:
        return self.poses_as < other  # type: ignore[operator,no-any-return]

    def __le__(self, other: object) -> bool:
        return self.poses_as <= other  # type: ignore[operator,no-any-return]

    def __gt__(self, other: object) -> bool:
        return self.poses_as > other  # type: ignore[operator,no-any-return]

    def __ge__(self, other: object) -> bool:
        return self.poses_as >= other  # type: ignore[operator,no-any-return]


def test_plain_prompt_reads_token_ids_as_plain_ints() -> None:
    prompt = plain_prompt((5, Posing(10**6, 5), 7))
    assert prompt == [5, 10**6, 7] and all(type(t) is int for t in prompt)
    assert plain_prompt([True, 3]) == [True, 3] and plain_prompt([True, 3])[0] is True  # a bool stays a bool (refused)


@pytest.mark.parametrize("position", [0, 4])
async def test_a_token_id_that_lies_about_its_range_is_refused_and_fails_no_neighbour(tiny_models, hf_greedy,
                                                                                        position) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 24)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        neighbour = asyncio.create_task(engine.generate(GOOD, greedy))
        await asyncio.sleep(0.05)  # the neighbour is decoding when the lie arrives
        hostile = list(GOOD)
        hostile[position] = Posing(10**6, 5)
        for call in (lambda: engine.generate(hostile, SamplingParams(max_tokens=3)),
                     lambda: engine.stream(hostile, SamplingParams(max_tokens=3)).__anext__()):
            with pytest.raises(InvalidParameterError) as refused:
                await call()
            assert refused.value.parameter == "prompt" and refused.value.value == 10**6
        assert (await neighbour).token_ids == expected
        assert engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0

